# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""One benchmark script against two installs of this package, side by side: the runs alternate (A, B, A, B, ...) in
fresh interpreters, so a slow spell of the machine falls on both. An install is a directory put first on PYTHONPATH
(`pip install --no-deps --target DIR <checkout>` of the older commit), or "-" for the environment's own. Each run
must print or write one JSON report whose "median_ms" maps variant to milliseconds; the result keeps every run and
the median over runs per install and variant.

    python benchmarks/compare_installs.py --before /tmp/old_site --after - --pairs 6 \
        --out benchmarks/results/FILE.json -- benchmarks/bench_peft_decode.py
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(script: list[str], site: str) -> dict:
    env = dict(os.environ)
    if site != "-":
        env["PYTHONPATH"] = os.pathsep.join([site] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "report.json")
        # run outside the checkout so the "-" install is the environment's, not the source tree on sys.path
        subprocess.run([sys.executable, *script, "--out", out], env=env, cwd=scratch, check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as handle:
            return json.load(handle)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="-")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--out", default=None)
    parser.add_argument("script", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    script = [s for s in args.script if s != "--"]
    if not script:
        parser.error("name the benchmark script after --")
    script[0] = os.path.abspath(script[0])
    runs = {"before": [], "after": []}
    for _ in range(args.pairs):
        for label, site in (("before", args.before), ("after", args.after)):
            runs[label].append(run_once(script, site))
            print(label, json.dumps(runs[label][-1]["median_ms"]), flush=True)
    variants = runs["before"][0]["median_ms"]
    summary = {label: {v: round(statistics.median(r["median_ms"][v] for r in reports), 3) for v in variants}
               for label, reports in runs.items()}
    report = {"script": script, "before": args.before, "after": args.after, "pairs": args.pairs,
              "median_of_run_medians_ms": summary,
              "after_over_before": {v: round(summary["after"][v] / summary["before"][v], 3) for v in variants},
              "runs": runs}
    print(json.dumps({k: report[k] for k in ("median_of_run_medians_ms", "after_over_before")}, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
