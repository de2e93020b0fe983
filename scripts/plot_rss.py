"""Draws each member's RSS over a soak from its samples (CSV: elapsed_s, handled, member,
rss_kib), one line per member process, against the messages handled so far.
Usage: CSV SVG TITLE"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

source, target, title = sys.argv[1], sys.argv[2], sys.argv[3]
members = defaultdict(lambda: ([], []))
with open(source, newline="") as f:
    for row in csv.DictReader(f):
        handled, rss = members[int(row["member"])]
        handled.append(int(row["handled"]) / 1e6)
        rss.append(int(row["rss_kib"]) / 1024)
fig, ax = plt.subplots(figsize=(9, 4.5))
for member, (handled, rss) in sorted(members.items()):
    ax.plot(handled, rss, linewidth=1, label=f"member {member}")
ax.set_xlabel("messages handled (millions)")
ax.set_ylabel("RSS (MiB)")
ax.set_ylim(bottom=0)
ax.set_title(title)
ax.grid(alpha=0.3)
if len(members) <= 12:
    ax.legend(fontsize=7, ncol=3)
fig.tight_layout()
fig.savefig(target)
