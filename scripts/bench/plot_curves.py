"""Draws the charts of scripts/bench/curves from its JSON lines (one kafka_bench report each,
with the sweep it belongs to and the swept value)."""
import json
import sys

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

source, out = sys.argv[1], sys.argv[2]
runs = [json.loads(line) for line in open(source) if line.strip()]


def chart(sweep, xlabel, name, xscale, fmt_x, ideal=None, yscale="linear"):
    points = sorted((r for r in runs if r["sweep"] == sweep), key=lambda r: r["value"])
    if not points:
        return
    xs = [fmt_x(r["value"]) for r in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["throughput_msg_s"] for r in points], marker="o", label="convoy")
    ax.plot(xs, [r["baseline_throughput_msg_s"] for r in points], marker="s", linestyle="--",
            label="bare rdkafka consumer (no handler, no order)")
    if ideal:
        label, bound = ideal
        ax.plot(xs, [bound(r) for r in points], linestyle=":", color="gray", label=label)
    if xscale == "symlog":
        ax.set_xscale("symlog", linthresh=0.1)
    else:
        ax.set_xscale(xscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("messages per second")
    if yscale == "log":
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    first = points[0]
    ax.set_title(f"Apache Kafka, {first['messages']:,}+ messages, order verified")
    fig.tight_layout()
    fig.savefig(f"{out}/{name}.svg")
    print(f"{out}/{name}.svg: {len(points)} points")


chart("keys", "distinct keys", "throughput-by-keys", "log", lambda v: v)
# With work w per message and k keys, no consumer that keeps each key's order can beat k / w.
chart("work", "handler work per message (ms, async; 1,000 keys)", "throughput-by-work", "symlog",
      lambda v: v / 1000.0,
      ideal=("every key busy all the time (keys ÷ work)",
             lambda r: r["keys"] / (r["value"] / 1e6) if r["value"] else float("nan")),
      yscale="log")
