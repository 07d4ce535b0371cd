"""HTTP benchmark: the same extraction in-process and through `headthief serve` on loopback.

1. exact on random:d=64 and random:d=384 (seed 1): seconds in-process, through HTTP with the default
   binary framing (``auto``: sparse where a request is at most a quarter nonzero, else .npy), with
   .npy only and with JSON, the ratio (medians of ``--repeat`` runs), requests per second, bytes sent,
   and whether the parameters are bit-identical; then the same as whole ``headthief extract`` commands;
2. load: C concurrent clients for S seconds on one key (default 32 x 60 s): requests, p50/p99 latency,
   throughput, 5xx, and the ledger against the answers received;
3. the PRADA detector (``--prada flag``): at which query each method is flagged, and natural queries;
4. defences (rounding, noise): each method's error through HTTP.

    .venv/bin/python benchmarks/bench_http.py [--dims 64,384] [--load-clients 32] [--load-seconds 60]
                                              [--skip-json-above 384] [--repeat 5]
                                              [--only timing,commands,load,prada,defences]
                                              [--sync full,normal]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HT = [sys.executable, "-m", "headthief.cli"]


class Serve:
    def __init__(self, target, db, *opts):
        self.log = Path(db).with_suffix(".err")
        self.proc = subprocess.Popen([*HT, "serve", "--target", target, "--db", str(db), "--port", "0", *opts],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        for _ in range(1200):
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", self.log.read_text())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text())
            time.sleep(0.05)
        raise TimeoutError("headthief serve did not start")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def key(db, name, *opts) -> str:
    return subprocess.run([*HT, "keys", "add", name, "--db", str(db), *opts], capture_output=True, text=True,
                          check=True).stdout.strip()


def used(db) -> dict:
    rows = json.loads(subprocess.run([*HT, "keys", "list", "--db", str(db), "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    return {r["name"]: r for r in rows}


def per_run(total: int, runs: int):
    """Queries charged per run: an integer when every run paid the same."""
    return total // runs if total % runs == 0 else round(total / runs, 1)


def timing(dims, skip_json_above, work: Path, syncs=("full",), repeat: int = 5) -> list[dict]:
    """The exact method in-process and through HTTP, each timed ``repeat`` times (the median is
    reported; each HTTP run is a new run id, so every run pays in full)."""
    from headthief.extraction.single.exact import extract_exact
    from headthief.oracles.http import HTTPOracle
    from headthief.targets import resolve
    rows = []
    for d in dims:
        spec = f"random:d={d},seed=1"
        t_local = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            local = extract_exact(resolve(spec).make_oracle(), verify=0, rng=np.random.default_rng(0))
            t_local.append(time.perf_counter() - t0)
        t_local = float(np.median(t_local))
        for sync, framing in [(sy, f) for sy in syncs for f in ("auto", "npy", "json")]:
            if framing == "json" and d > skip_json_above:
                rows.append({"d": d, "framing": framing, "sync": sync, "skipped": f"d > {skip_json_above}"})
                continue
            db = work / f"timing{d}-{sync}.sqlite"
            with Serve(spec, db, "--sync", sync) as s:
                k = key(db, f"{framing}")
                t_http, ident = [], True
                for _ in range(repeat if framing != "json" or d <= 64 else 1):
                    with HTTPOracle(s.url, api_key=k, framing=framing) as o:
                        t0 = time.perf_counter()
                        res = extract_exact(o, verify=0, rng=np.random.default_rng(0))
                        t_http.append(time.perf_counter() - t0)
                        stats = o.stats()
                    ident &= np.array_equal(res.W, local.W) and np.array_equal(res.v, local.v)
                runs, t_http = len(t_http), float(np.median(t_http))
                reqs = stats["requests"]
                rows.append({"d": d, "framing": framing, "sync": sync, "queries": res.queries,
                             "in_process_s": round(t_local, 3), "http_s": round(t_http, 3),
                             "ratio": round(t_http / t_local, 2), "runs": runs, "requests": reqs,
                             "requests_per_s": round(reqs / t_http, 1),
                             "sent": "+".join(f"{v} {k}" for k, v in stats["sent"].items()),
                             "MB_sent": round(stats["sent_bytes"] / 1e6, 2), "bit_identical": bool(ident),
                             "charged_per_run": per_run(used(db)[framing]["used"], runs)})
    return rows


def commands(d: int, work: Path, repeat: int = 5) -> list[dict]:
    """Whole commands as a user types them (process start, import, model check included), median of
    ``repeat``: ``headthief extract --target random:d=D,seed=1 --method exact --verify 0 --json`` against
    the same with ``--target http://...`` (a fresh key per run, so every run pays)."""
    spec = f"random:d={d},seed=1"
    base = ["extract", "--method", "exact", "--verify", "0", "--json", "--quiet"]

    def timed(args) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = subprocess.run([*HT, *base, *args], capture_output=True, text=True, check=True)
        return time.perf_counter() - t0, json.loads(r.stdout)

    local = [timed(["--target", spec]) for _ in range(repeat)]
    rows = [{"command": f"extract --target {spec}", "median_s": round(float(np.median([t for t, _ in local])), 3),
             "queries": local[0][1]["queries"], "check_queries": local[0][1]["check_queries"]}]
    db = work / f"commands{d}.sqlite"
    with Serve(spec, db) as s:
        remote = [timed(["--target", s.url, "--api-key", key(db, f"c{i}")]) for i in range(repeat)]
    rows.append({"command": "extract --target http://127.0.0.1:PORT", "median_s":
                 round(float(np.median([t for t, _ in remote])), 3), "queries": remote[0][1]["queries"],
                 "check_queries": remote[0][1]["check_queries"],
                 "charged_per_run": per_run(sum(r["used"] for r in used(db).values()), repeat)})
    rows[1]["ratio"] = round(rows[1]["median_s"] / rows[0]["median_s"], 2)
    return rows


def load(clients, seconds, work: Path) -> dict:
    from headthief.server.load import run_load
    db = work / "load.sqlite"
    k = key(db, "load")
    with Serve("random:d=16,seed=3", db) as s:
        r = run_load(s.url, k, d=16, clients=clients, seconds=seconds, seed=0).as_dict()
    r["ledger_queries"] = used(db)["load"]["used"]
    r["ledger_equals_answers"] = r["ledger_queries"] == r["fresh_queries"]
    audit = subprocess.run([*HT, "keys", "audit", "--db", str(db)], capture_output=True, text=True)
    r["audit_ok"] = audit.returncode == 0
    return r


METHODS = [("exact", ["--method", "exact"]), ("exact --probes gaussian", ["--method", "exact", "--probes", "gaussian"]),
           ("lowrank", ["--method", "lowrank"]), ("noisy (tau 1e-6)", ["--method", "noisy", "--noise", "1e-6"]),
           ("membership", ["--method", "membership"])]


def extract(url, k, args, out: Path) -> tuple[int, dict | None, str]:
    r = subprocess.run([*HT, "extract", "--target", url, "--api-key", k, "--verify", "0", "--json", "--quiet",
                        "--no-check", "--save", str(out), *args], capture_output=True, text=True)
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else None), r.stderr.strip()


def prada(d: int, work: Path) -> list[dict]:
    db = work / "prada.sqlite"
    rows = []
    with Serve(f"random:d={d},seed=1", db, "--prada", "flag") as s:
        for i, (name, args) in enumerate(METHODS):
            k = key(db, f"m{i}")
            rc, row, err = extract(s.url, k, args, work / f"prada{i}.npz")
            u = used(db)[f"m{i}"]
            rows.append({"method": name, "queries": u["used"], "flagged_at": u["flagged_at"], "rc": rc})
        from headthief.oracles.http import HTTPOracle
        k = key(db, "natural")
        rng = np.random.default_rng(0)
        with HTTPOracle(s.url, api_key=k) as o:
            for _ in range(250):
                o.query([rng.normal(size=(int(rng.integers(1, 8)), d)) for _ in range(8)])
        u = used(db)["natural"]
        rows.append({"method": "natural queries (Gaussian, N in 1..7)", "queries": u["used"],
                     "flagged_at": u["flagged_at"], "rc": 0})
    return rows


def defences(d: int, work: Path) -> list[dict]:
    from headthief.models.attention import random_head
    head = random_head(d, rng=1)
    rows = []
    for dname, opts in [("none", []), ("round:6", ["--noise-mode", "round:6"]), ("round:3", ["--noise-mode", "round:3"]),
                        ("uniform 1e-6", ["--noise", "1e-6", "--noise-mode", "uniform"]),
                        ("uniform 1e-3", ["--noise", "1e-3", "--noise-mode", "uniform"])]:
        db = work / f"def-{dname.replace(' ', '_').replace(':', '')}.sqlite"
        with Serve(f"random:d={d},seed=1", db, *opts) as s:
            for i, (name, args) in enumerate(METHODS):
                if name.endswith("gaussian"):
                    continue
                if name.startswith("noisy"):    # the server publishes its tolerance (noisy:TAU, rounded:K)
                    name, args = "noisy (tau from the server)", ["--method", "noisy"]
                k = key(db, f"m{i}")
                out = work / f"def{i}.npz"
                rc, row, err = extract(s.url, k, args, out)
                W_err = v_err = None
                if rc == 0:
                    with np.load(out) as z:
                        W_err = float(np.linalg.norm(z["W"] - head.W) / np.linalg.norm(head.W))
                        v = z["v"]
                        if name == "membership":       # sign answers identify v's direction only
                            v_err = float(np.linalg.norm(v / np.linalg.norm(v) - head.v / np.linalg.norm(head.v)))
                        else:
                            v_err = float(np.linalg.norm(v - head.v) / np.linalg.norm(head.v))
                rows.append({"defence": dname, "method": name, "rc": rc, "W_rel_err": W_err, "v_err": v_err,
                             "queries": used(db)[f"m{i}"]["used"], "error": err.splitlines()[-1][:80] if rc else ""})
    return rows


def table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: "-" if v is None else (f"{v:.2e}" if abs(v) < 1e-2 and v != 0 else f"{v:.4g}") if isinstance(v, float) else str(v)  # noqa: E731
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(n) for c, n in zip(cols, w)).rstrip()]
    lines += ["  ".join(x.ljust(n) for x, n in zip(row, w)).rstrip() for row in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,384")
    p.add_argument("--skip-json-above", type=int, default=10_000, help="skip JSON framing above this d")
    p.add_argument("--load-clients", type=int, default=32)
    p.add_argument("--load-seconds", type=float, default=60.0)
    p.add_argument("--detector-d", type=int, default=16)
    p.add_argument("--only", default="timing,commands,load,prada,defences")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per row (the median is reported)")
    p.add_argument("--sync", default="full", help="ledger durability modes to time: full, normal or full,normal")
    a = p.parse_args(argv)
    parts = set(a.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "timing" in parts:
            print("== exact: in-process vs HTTP (loopback) ==")
            print(table(timing([int(x) for x in a.dims.split(",")], a.skip_json_above, work, a.sync.split(","),
                               a.repeat)), flush=True)
        if "commands" in parts:
            d = max(int(x) for x in a.dims.split(","))
            print(f"\n== whole commands, random:d={d}, exact, median of {a.repeat} ==")
            print(table(commands(d, work, a.repeat)), flush=True)
        if "load" in parts:
            print(f"\n== load: {a.load_clients} clients x {a.load_seconds:g} s, one key, random:d=16 ==")
            print(table([load(a.load_clients, a.load_seconds, work)]), flush=True)
        if "prada" in parts:
            print(f"\n== PRADA detector (--prada flag, delta 0.9, 100 distances), random:d={a.detector_d} ==")
            print(table(prada(a.detector_d, work)), flush=True)
        if "defences" in parts:
            print(f"\n== defences: errors through HTTP, random:d={a.detector_d} ==")
            print(table(defences(a.detector_d, work)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
