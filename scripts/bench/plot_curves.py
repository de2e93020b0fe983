"""Draws the charts of scripts/bench/curves from its JSON lines (one report each, with the sweep
it belongs to, the swept value and the side that ran: convoy's kafka_bench or Parallel Consumer)."""
import json
import sys

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

source, out = sys.argv[1], sys.argv[2]
runs = [json.loads(line) for line in open(source) if line.strip()]


def points(sweep, side="convoy"):
    return sorted((r for r in runs if r["sweep"] == sweep and r.get("side", "convoy") == side),
                  key=lambda r: r["value"])


def start(sweep):
    """convoy's points of `sweep` and a fresh figure, or None when the sweep has none."""
    convoy = points(sweep)
    if not convoy:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    return convoy, fig, ax


def against_bare(ax, xs, convoy, convoy_label, bare_label):
    """convoy's throughput and the bare consumer's of the same runs."""
    ax.plot(xs, [r["throughput_msg_s"] for r in convoy], marker="o", label=convoy_label)
    ax.plot(xs, [r["baseline_throughput_msg_s"] for r in convoy], marker="s", linestyle="--",
            label=bare_label)


def save(fig, ax, name, title, n):
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(f"{out}/{name}.svg")
    plt.close(fig)
    print(f"{out}/{name}.svg: {n} points")


def throughput(sweep, xlabel, name, xscale, fmt_x, ideal=None, yscale="linear"):
    if not (started := start(sweep)):
        return
    convoy, fig, ax = started
    xs = [fmt_x(r["value"]) for r in convoy]
    against_bare(ax, xs, convoy, "convoy", "bare rdkafka consumer (no handler, no order)")
    pc = points(sweep, "pc")
    if pc:
        ax.plot([fmt_x(r["value"]) for r in pc], [r["throughput_msg_s"] for r in pc], marker="^",
                label="Parallel Consumer (KEY order, its own topic of the same shape)")
    if ideal:
        label, bound = ideal
        ax.plot(xs, [bound(r) for r in convoy], linestyle=":", color="gray", label=label)
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
    ax.legend(fontsize="small")
    save(fig, ax, name, f"Apache Kafka, {convoy[0]['messages']:,}+ messages, order verified",
         len(convoy) + len(pc))


def latency_by_rate():
    if not (started := start("rate")):
        return
    convoy, fig, ax = started
    xs = [r["value"] for r in convoy]
    for field, label, style in (("p50_ms", "p50", "o-"), ("p99_ms", "p99", "s-"),
                                ("p999_ms", "p99.9", "^-")):
        ax.plot(xs, [r[field] for r in convoy], style, label=f"convoy {label}")
    stages = [r for r in convoy if r.get("stages")]
    if stages:
        ax.plot([r["value"] for r in stages], [r["stages"]["in_engine_p99_ms"] for r in stages],
                "x:", label="p99 inside convoy (received → handler)")
    for r in convoy:
        if not r.get("rate_held", True):
            ax.annotate("not held", (r["value"], r["p99_ms"]), textcoords="offset points",
                        xytext=(-20, 8), fontsize="small")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (msg/s; 1,000 keys, no-op handler, live producer)")
    ax.set_ylabel("produce → handled latency (ms)")
    ax.legend(fontsize="small")
    secs = convoy[0]["messages"] / convoy[0]["value"]
    save(fig, ax, "latency-by-rate", f"Apache Kafka, {secs:.0f} s a point, order verified",
         len(convoy))


def by_partitions():
    if not (started := start("partitions")):
        return
    convoy, fig, ax = started
    xs = [r["value"] for r in convoy]
    against_bare(ax, xs, convoy, "convoy msg/s", "bare rdkafka consumer msg/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:,.0f}" for x in xs])
    ax.set_xlabel("partitions of the topic (1,000 keys, no-op handler)")
    ax.set_ylabel("messages per second")
    ax.set_ylim(bottom=0)
    threads = ax.twinx()
    threads.plot(xs, [r.get("threads", 0) for r in convoy], color="gray", marker="x",
                 linestyle=":", label="threads of the process (convoy)")
    threads.set_ylabel("threads")
    threads.set_ylim(bottom=0, top=max(r.get("threads", 0) for r in convoy) * 2 + 1)
    lines = ax.get_legend_handles_labels()
    more = threads.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize="small", loc="lower left")
    save(fig, ax, "throughput-by-partitions",
         f"Apache Kafka, {convoy[0]['messages']:,} messages, order verified", len(convoy))


throughput("keys", "distinct keys", "throughput-by-keys", "log", lambda v: v)
# With work w per message and k keys, no consumer that keeps each key's order can beat k / w.
throughput("work", "handler work per message (ms; 1,000 keys)", "throughput-by-work", "symlog",
           lambda v: v / 1000.0,
           ideal=("every key busy all the time (keys ÷ work)",
                  lambda r: r["keys"] / (r["value"] / 1e6) if r["value"] else float("nan")),
           yscale="log")
latency_by_rate()
by_partitions()
