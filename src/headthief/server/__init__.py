"""A model API on loopback (issue 11): ``headthief serve`` and its accounts, defences and wire formats.

:class:`~headthief.server.app.Service` is the API without HTTP; :func:`~headthief.server.app.create_app`
wraps it in FastAPI (imported only there: ``import headthief`` stays numpy + scipy). The client side is
:class:`headthief.oracles.http.HTTPOracle`.
"""

from .accounts import Accounts, AccountsError, KeyRecord
from .defences import Defence, Prada, parse_defence

__all__ = ["Accounts", "AccountsError", "KeyRecord", "Defence", "Prada", "parse_defence"]
