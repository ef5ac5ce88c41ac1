"""The replay and planner areas of ``docs/results.md``: their rows and notes, from the JSON ``benchmarks.replay`` and
``benchmarks.planner`` write (goal lines come from ``goal_runs``, which ``benchmarks.results_table`` renders itself).
"""

from __future__ import annotations

from typing import Any

from benchmarks._table_cells import Table, percent


def _goal(data: dict[str, Any], key: str) -> str:
    """This run's figure of goal ``key`` and its worst configuration, for a note."""
    goal = next(g for g in data["goals"] if g["key"] == key)
    where = f"failed: {', '.join(goal['missing'])}" if goal["missing"] else f"worst {goal['worst_config']}"
    return f"`{key}` {percent(goal['value'])} ({where}; goal {goal['direction']} {percent(goal['target'])})"


def replay(data: dict[str, Any]) -> Table:
    """Trace replay (dPRO): each trace replayed against another run of its layout, what-ifs against measured runs,
    simulated rank counts."""
    rows = [[r["kind"], r["what"], f"{r['predicted_ms']:.0f}",
             "-" if r.get("measured_ms") is None else f"{r['measured_ms']:.0f}",
             percent(r.get("error"), signed=True)] for r in data["rows"]]
    overhead = data.get("recording_overhead", {})
    notes = [f"this run: {_goal(data, 'replay_heldout_error_max')}, {_goal(data, 'whatif_error_max')}; what-if "
             f"maximum paired by repeat {percent(data.get('whatif_error_max_paired'))}, first repeat alone "
             f"{percent(data.get('whatif_error_max_first_repeat'))} (diagnostics)",
             "rows \"run to run\" (the traced run's own untraced steps against the held-out run) and \"replay of its "
             "own steps\" (the trace against itself) are diagnostics beside the goals",
             f"ranks' heap: {data['rank_heap']}; recording costs {overhead.get('overhead_per_op_us', float('nan')):.0f}"
             f" µs per collective or point-to-point op; Perfetto example: "
             f"benchmarks/results/{data['perfetto_example']}",
             f"{data['workload']}; {data['statistic']}; {data['note']}"]
    return Table(["kind", "what", "predicted ms", "measured ms", "error"], rows, notes)


def planner(data: dict[str, Any]) -> Table:
    """The default planner's held-out predictions per layout, beside the paired and replayed ones (not held out)
    and the replayer's leave-one-layout-out."""
    def ms(value: object) -> str:
        return f"{1e3 * value:.0f}" if isinstance(value, float) else "-"

    rows = [[r["layout"], ms(r["measured_s"]) if "error" in r else str(r["measured_s"]), ms(r["predicted_s"]),
             percent(r.get("error"), signed=True), percent(r.get("paired_error"), signed=True),
             ms(r.get("replay_predicted_s")), percent(r.get("replay_error"), signed=True),
             ms(r.get("replay_loo_predicted_s")), percent(r.get("replay_loo_error"), signed=True)]
            for r in data["rows"]]
    s = data["summary"]
    notes = [
        f"this run: {_goal(data, 'error_max_leave_one_out')}, {_goal(data, 'regret')}: picked {s['pick']}, "
        f"fastest measured {s['best_measured']}",
        f"not held out (beside the goals): paired with each run's own plan max |error| "
        f"{percent(s.get('max_abs_paired_error'))}; trace replay max {percent(s.get('max_abs_replay_error'))}, "
        f"paired by round {percent(s.get('max_abs_replay_paired_error'))}, its pick {s.get('replay_pick', '-')}, "
        f"regret {percent(s.get('replay_regret'))}",
        f"trace replay leave-one-layout-out (no calibration run of the layout it prices): max |error| "
        f"{percent(s.get('max_abs_replay_loo_error'))}, its pick {s.get('replay_loo_pick', '-')}, regret "
        f"{percent(s.get('replay_loo_regret'))}",
        f"{data['rounds']} rounds; {data['workload']}, {data['world_size']} ranks on heap {data['rank_heap']}; "
        f"{data['predictions']}",
    ]
    return Table(["layout", "measured ms", "predicted ms", "error", "paired error", "replay ms", "replay error",
                  "replay LOO ms", "replay LOO error"], rows, notes)
