#!/usr/bin/env python3
"""Checks expectations against a Prometheus server's HTTP API (/api/v1/query).

Used by scrape_test.sh. Each expectation is 'PROMQL OP VALUE', split at the last two spaces:
OP is one of == != >= <= > < ~= (~= : within 1e-9 relative, or --tol absolute), or the single
word 'exists' ('PROMQL exists': at least one sample). Every sample the query returns must satisfy
the comparison, and there must be at least one. The expectations are polled until all pass or the
deadline; exit 0 when they pass, 1 otherwise (the last failure of each is printed).
"""
import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

OPS = {
    "==": lambda a, b, t: a == b,
    "!=": lambda a, b, t: a != b,
    ">=": lambda a, b, t: a >= b,
    "<=": lambda a, b, t: a <= b,
    ">": lambda a, b, t: a > b,
    "<": lambda a, b, t: a < b,
    "~=": lambda a, b, t: abs(a - b) <= max(t, 1e-9 * abs(b)),
}


def parse_expectation(text):
    parts = text.rsplit(" ", 2)
    if len(parts) >= 2 and parts[-1] == "exists":
        return text[: -len(" exists")].strip(), "exists", None
    if len(parts) != 3 or parts[1] not in OPS:
        raise ValueError(f"bad expectation {text!r}: want 'PROMQL OP VALUE' or 'PROMQL exists'")
    return parts[0].strip(), parts[1], float(parts[2])


def query(base, promql):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"query failed: {body}")
    data = body["data"]
    if data["resultType"] == "scalar":
        return [({}, float(data["result"][1]))]
    if data["resultType"] == "vector":
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]
    raise RuntimeError(f"unsupported result type {data['resultType']}")


def check(base, exp, tol):
    promql, op, want = exp
    try:
        samples = query(base, promql)
    except urllib.error.HTTPError as e:
        return False, f"{promql}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    except (urllib.error.URLError, OSError, RuntimeError, ValueError) as e:
        return False, f"{promql}: {e}"
    if not samples:
        return False, f"{promql}: no series"
    if op == "exists":
        return True, f"{promql}: {len(samples)} series"
    for metric, value in samples:
        if math.isnan(value) or not OPS[op](value, want, tol):
            return False, f"{promql}: got {value} {metric}, want {op} {want}"
    return True, f"{promql} = {', '.join(repr(v) for _, v in samples)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prometheus", required=True, help="http://127.0.0.1:PORT")
    ap.add_argument("--deadline", type=float, required=True, help="unix time to give up at")
    ap.add_argument("--tol", type=float, default=0.0)
    ap.add_argument("expect", nargs="+")
    args = ap.parse_args()
    try:
        pending = [(e, parse_expectation(e)) for e in args.expect]
    except ValueError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 2
    last = {}
    while pending:
        still = []
        for text, exp in pending:
            ok, msg = check(args.prometheus, exp, args.tol)
            if ok:
                print(f"  ok    {msg}", flush=True)
            else:
                last[text] = msg
                still.append((text, exp))
        pending = still
        if pending and time.time() < args.deadline:
            time.sleep(0.5)
        elif pending:
            for text, _ in pending:
                print(f"  FAIL  {last[text]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
