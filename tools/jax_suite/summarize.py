"""Group a probe log (``conftest.py``) by status: counts, then one line per
distinct non-ok outcome. ``python summarize.py probe.jsonl [...]``."""

from __future__ import annotations

import collections
import json
import os
import re
import sys


def main(paths: list[str]) -> None:
    rows = [json.loads(line) for p in paths if os.path.exists(p) for line in open(p)]
    print(dict(collections.Counter(r["status"] for r in rows)))
    seen = set()
    for r in rows:
        if r["status"] == "ok":
            continue
        test = re.sub(r"\d+$", "", r["test"].split("[")[0])
        key = (r["status"], test, str(r["err"])[:80])
        if key not in seen:
            seen.add(key)
            print(f"{r['status']:<24} {r['test'][:100]}  {r.get('where', '')}  {str(r['err'])[:240]}")


if __name__ == "__main__":
    main(sys.argv[1:])
