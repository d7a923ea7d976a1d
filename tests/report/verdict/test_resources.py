"""resources.py: the throughput rule tells a busier machine from a slower recipe, on a CPU and on CUDA; the
memory rule fails a leak and a peak over the budget."""



from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN
from pilotrun.report.verdict.verdict import judge_summary
from tests.report.synthetic import SyntheticRun, busier_machine, changed, crashed_and_resumed, verdict_of


def test_throughput_steady_fails_when_it_decays(tmp_path):
    def change(run):  # the run itself slows: its CPU seconds per token grow with the wall time
        run.train_seconds_per_update = lambda step: 0.5 * (1 + step / 10.0)
        run.cpu_seconds_per_update = lambda step: 0.45 * (1 + step / 10.0)
    _, rules = verdict_of(tmp_path, change)
    assert (
        rules["throughput_steady"].status == FAIL
        and "the run itself slowed" in rules["throughput_steady"].figure
    )


def test_throughput_steady_warns_when_only_the_machine_got_busier(tmp_path):
    verdict, rules = verdict_of(tmp_path, busier_machine)
    rule = rules["throughput_steady"]
    assert rule.status == WARN and verdict.decision == "GO"
    assert rule.figure.startswith("the machine got busier") and "(ratio 0.25)" in rule.figure
    assert "(ratio 1.00)" in rule.figure  # tokens per CPU second held
    assert [w.name for w in verdict.warnings] == ["throughput_steady"]


def test_throughput_warns_when_the_process_lost_its_cpu_share_even_if_each_token_cost_more(tmp_path):
    """Two competing processes on the trainer's core: it gets a third of the CPU per training second, and each
    token also costs it more CPU time (every switch evicts its caches). Neither figure alone acquits the
    recipe, but the lost share says other load took the CPU: a WARN naming both, not a FAIL."""
    def shared_core(run):
        run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5
        # twice the CPU per token, half the share
        run.cpu_seconds_per_update = lambda step: 0.9 if step > 40 else 0.45
    verdict, rules = verdict_of(tmp_path, shared_core)
    rule = rules["throughput_steady"]
    assert rule.status == WARN and verdict.decision == "GO", rule.figure
    assert rule.figure.startswith("the machine got busier") and "(ratio 0.25)" in rule.figure
    assert "tok (ratio 0.50)" in rule.figure and "the process got 0.50 of its share of the CPU" in rule.figure
    assert "judge the recipe's own speed on a quiet machine" in rule.figure


def test_throughput_fails_when_the_share_held_and_each_token_cost_more(tmp_path):
    # the CPU share stays at 0.9 while each update takes four times the CPU and the wall
    def slower_recipe(run):
        run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5
        run.cpu_seconds_per_update = lambda step: 1.8 if step > 40 else 0.45
    _, rules = verdict_of(tmp_path, slower_recipe)
    rule = rules["throughput_steady"]
    assert rule.status == FAIL and "the run itself slowed" in rule.figure, rule.figure


def test_throughput_contention_is_not_inferred_without_cpu_time_or_on_cuda(tmp_path):
    def build(name):
        return crashed_and_resumed(tmp_path / name, make_run=lambda d, **kw: changed(SyntheticRun(d, **kw),
                                                                                  busier_machine))
    run = build("none")
    for event in run.events:
        if event["event"] == "train":
            del event["window"]["cpu_seconds"]  # a record from before CPU time was kept
    run.write()
    rule = {r.name: r for r in judge_summary(summarize_run(tmp_path / "none")).rules}["throughput_steady"]
    assert rule.status == FAIL and "CPU time not recorded" in rule.figure
    run = build("cuda")
    for session in run.run["sessions"]:
        session["hardware"]["device"] = "cuda"
    run.write()
    rule = {r.name: r for r in judge_summary(summarize_run(tmp_path / "cuda")).rules}["throughput_steady"]
    assert rule.status == FAIL and "device time not recorded" in rule.figure  # CPU time is no measure there


def test_throughput_on_cuda_tells_abusier_machine_by_the_device_seconds(tmp_path):
    """On CUDA each window records the device seconds of its updates (timing events): when the wall time grew
    but the device did the same work per token, the machine got busier (WARN); when the device seconds grew
    with it, the run slowed (FAIL)."""
    def build(name, device_seconds_per_update):
        run = crashed_and_resumed(tmp_path / name, make_run=lambda d, **kw: changed(SyntheticRun(d, **kw),
                                                                                  busier_machine))
        for session in run.run["sessions"]:
            session["hardware"]["device"] = "cuda"
        for event in run.events:
            if event["event"] == "train":
                window = event["window"]
                window["device_seconds"] = window["updates_attempted"] * device_seconds_per_update(
                    event["step"]
                )
        run.write()
        return {r.name: r for r in judge_summary(summarize_run(run.run_dir)).rules}["throughput_steady"]

    held = build("held", lambda step: 0.3)
    assert held.status == WARN and held.figure.startswith("the machine got busier")
    assert "per device second" in held.figure and "tokens per device second) held" in held.figure
    grew = build("grew", lambda step: 1.2 if step > 40 else 0.3)
    assert grew.status == FAIL and "the run itself slowed" in grew.figure


def test_memory_fails_on_growth_and_on_budget(tmp_path):
    def leak(run):
        run.rss_mb = lambda step: 500.0 + 40.0 * step
    _, rules = verdict_of(tmp_path / "leak", leak)
    assert rules["memory"].status == FAIL and "growth" in rules["memory"].figure
    _, rules = verdict_of(tmp_path / "budget", memory_budget_gb=0.25)  # 256 MB < 500 MB peak
    assert rules["memory"].status == FAIL and "peak <= 0.25 GB" in rules["memory"].threshold
    _, rules = verdict_of(tmp_path / "fits", memory_budget_gb=1.0)
    assert rules["memory"].status == PASS


def _spinning_threads_on_a_busy_machine(others_busy: bool):
    """Two threads; from update 40 on another job wants the cores. Each update takes five times the wall time
    and four times the CPU (threads waiting on a descheduled sibling spin), while the share of the CPU barely
    moves: by the work per token alone the run would look slower itself. `others_busy`: the windows also show
    the rest of the machine using about a CPU more and the threads descheduled far more often."""
    def change(run):
        run.train_seconds_per_update = lambda step: 2.5 if step > 40 else 0.5
        run.cpu_seconds_per_update = lambda step: 3.6 if step > 40 else 0.9
        quiet = (lambda step: 0.05), (lambda step: 5)
        busy = (lambda step: 2.6 if step > 40 else 0.05), (lambda step: 400 if step > 40 else 5)
        run.other_cpu_seconds_per_update, run.involuntary_switches_per_update = busy if others_busy else quiet
    return change


def test_threads_that_lost_the_cpu_to_other_processes_warn_naming_the_machine_not_fail_the_recipe(tmp_path):
    verdict, rules = verdict_of(tmp_path, _spinning_threads_on_a_busy_machine(others_busy=True))
    rule = rules["throughput_steady"]
    assert rule.status == WARN and verdict.decision == "GO", rule.figure
    assert (
        rule.figure.startswith("the machine got busier, not the recipe slower: ")
        and "(ratio 0.20)" in rule.figure
    )
    assert (
        "other processes used 0.08 -> 0.99 CPUs" in rule.figure and "8 -> 152 times per second" in rule.figure
    )
    assert "lost CPU to other processes" in rule.figure and "the run itself slowed" not in rule.figure
    assert "window.involuntary_switches" in rule.evidence


def test_the_same_slowdown_with_the_machine_quiet_is_the_recipes(tmp_path):
    verdict, rules = verdict_of(tmp_path, _spinning_threads_on_a_busy_machine(others_busy=False))
    rule = rules["throughput_steady"]
    assert rule.status == FAIL and verdict.decision == "NO-GO" and "the run itself slowed" in rule.figure, (
        rule.figure
    )
    assert (
        "other processes used 0.08 -> 0.02 CPUs, this run's threads descheduled for them 8 -> 2 times"
        in rule.figure
    )
