"""The chaos soak's pictures: a timeline (leader and term, faults, fires per second) and the
distribution of failover gaps. PNG through matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import datetime as dt
import itertools
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from bench.chaos_records import Fault, LeaseSample

FAULT_COLOURS = {
    "leader": "tab:red",
    "standby": "tab:blue",
    "db": "tab:purple",
    "nats": "tab:orange",
    "devmongo": "tab:brown",
    "worker": "tab:green",
    "clock": "tab:cyan",
}


def _colour(kind: str) -> str:
    return FAULT_COLOURS[kind.split("-")[0]]


def plot_timeline(
    path: Path,
    since: dt.datetime,
    until: dt.datetime,
    samples: list[LeaseSample],
    faults: list[Fault],
    stored: list[dt.datetime],
    title: str,
) -> None:
    def x(moment: dt.datetime) -> float:
        return (moment - since).total_seconds()

    fig, (lead, fault_ax, rate) = plt.subplots(
        3, 1, sharex=True, figsize=(13, 8), gridspec_kw={"height_ratios": [1.5, 2, 1.5]}
    )
    fig.suptitle(f"chaos soak timeline ({title})", fontsize=10)

    # The term, and where no replica held a valid lease (or the lease could not be read,
    # during a stall of the server) shaded: the holders themselves are in report.json.
    lead.step(
        [x(s.at) for s in samples],
        [s.term for s in samples],
        where="post",
        color="tab:green",
        linewidth=1.2,
    )
    for before, sample in itertools.pairwise(samples):
        if before.holder is None or (sample.at - before.at).total_seconds() > 0.5:
            lead.axvspan(x(before.at), x(sample.at), color="0.8", linewidth=0)
    lead.set_ylabel("leader's term\n(grey: no leader)")

    kinds = sorted({f.kind for f in faults})
    for row, kind in enumerate(kinds):
        spans = [
            (x(f.started), max(0.3, ((f.ended or f.started) - f.started).total_seconds()))
            for f in faults
            if f.kind == kind
        ]
        fault_ax.broken_barh(spans, (row - 0.4, 0.8), color=_colour(kind))
    fault_ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    fault_ax.set_ylabel("faults")

    # Past the window's end too: fires due late in it may be stored during the catch-up.
    end = max([at for at in stored if at <= until + dt.timedelta(seconds=30)], default=until)
    per_second = Counter(int(x(at)) for at in stored if since <= at <= end)
    seconds = range(int(x(end)) + 1)
    rate.bar(list(seconds), [per_second.get(s, 0) for s in seconds], width=1.0, color="tab:gray")
    rate.set_ylabel("fires stored / s")
    rate.set_xlabel("seconds since the window opened")
    rate.axvline(x(until), color="black", linewidth=0.8, linestyle="--")
    rate.set_xlim(0, max(x(end), x(until)) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gaps(path: Path, gaps: list[dict[str, Any]], title: str) -> None:
    fig, (gap_ax, take_ax) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    fig.suptitle(f"failover after a fault of the leader ({title})", fontsize=10)
    kinds = sorted({g["kind"] for g in gaps})
    for ax, key, label in (
        (gap_ax, "gap_s", "fault to the new term's first fire (s)"),
        (take_ax, "takeover_s", "fault to the new term's lease (s)"),
    ):
        values = [[g[key] for g in gaps if g["kind"] == kind] for kind in kinds]
        if any(values):
            ax.hist(values, bins=20, stacked=True, label=kinds)
        ax.set_xlabel(label)
    gap_ax.set_ylabel("faults")
    if kinds:
        gap_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
