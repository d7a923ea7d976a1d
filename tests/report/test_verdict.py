"""verdict: every rule has a PASS case (the healthy synthetic pilot) and a FAIL case built from a small change."""

import json
import math

import pytest

from pilotrun.commands.cli import main
from pilotrun.report.rules import QK_CLIP
from pilotrun.report.summarize import summarize_run
from pilotrun.report.verdict import (
    FAIL,
    PASS,
    WARN,
    ThresholdError,
    Thresholds,
    format_verdict,
    judge,
    judge_summary,
    parse_thresholds,
)
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def _verdict(tmp_path, change=None, thresholds=None, build=crashed_and_resumed, **kwargs):
    """Build a pilot-shaped synthetic run after `change(run)` set its figures; judge it."""
    holder = {}

    def builder(run_dir, **kw):
        run = SyntheticRun(run_dir, **kw)
        if change is not None:
            change(run)
        holder["run"] = run
        return run

    if build is crashed_and_resumed:
        run = crashed_and_resumed(tmp_path / "r", make_run=builder, **kwargs)
    else:
        run = build(builder, tmp_path / "r", **kwargs)
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"), thresholds or Thresholds())
    return verdict, {r.name: r for r in verdict.rules}


def test_healthy_pilot_passes_every_rule(tmp_path):
    verdict, rules = _verdict(tmp_path)
    assert {name: r.status for name, r in rules.items()} == dict.fromkeys(rules, PASS)
    assert verdict.decision == "GO"
    assert "does not say the final model will be good" in verdict.statement
    assert "60 applied updates" in verdict.statement
    assert "3 replayed window(s) compared, 0 differ" in rules["resumed"].figure


def test_record_valid_fails_on_inconsistent_record(tmp_path):
    def change(run):
        run.tokens_per_microbatch += 1  # session_start then disagrees with every window's tokens
    verdict, rules = _verdict(tmp_path, change)
    assert rules["record_valid"].status == FAIL and verdict.decision == "NO-GO"
    assert "NO-GO: record_valid" in verdict.statement


def test_judge_requires_the_pilot_to_have_finished(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)  # killed, never resumed: no session_end at max_steps
    run.write()
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["record_valid"]
    assert rule.status == FAIL and "no session_end at step 60" in rule.figure
    finished = crashed_and_resumed(tmp_path / "f")
    finished.write()
    assert judge(tmp_path / "f").decision == "GO"


def test_losses_finite_fails_on_nan_val_loss(tmp_path):
    def change(run):
        run.val_loss = lambda step: math.nan if step == 50 else 2.5
    _, rules = _verdict(tmp_path, change)
    assert rules["losses_finite"].status == FAIL
    assert "val loss nan at step 50" in rules["losses_finite"].figure


def _noise(step):
    """A deterministic stand-in for batch-to-batch loss noise, in [-1, 1]."""
    return math.sin(step * 12.9898) * 43758.5453 % 2 - 1


def test_loss_decreased_fails_when_flat_and_warns_when_small(tmp_path):
    def flat(run):
        run.loss = lambda step: 3.0
    _, rules = _verdict(tmp_path / "flat", flat)
    assert rules["loss_decreased"].status == FAIL
    assert rules["loss_decreased"].figure.startswith("not learning") and "+0.00% drop" in rules["loss_decreased"].figure

    def small(run):
        run.loss = lambda step: 3.0 - 0.001 * step  # a real (noise-free) drop of 1.6%: learning, slowly
    _, rules = _verdict(tmp_path / "small", small)
    assert rules["loss_decreased"].status == WARN


def test_loss_decreased_fails_a_drop_of_a_tenth_of_a_percent_like_an_lr_of_zero(tmp_path):
    def lr_zero(run):
        run.loss = lambda step: 3.0 - 0.00005 * step + 0.02 * _noise(step)
    verdict, rules = _verdict(tmp_path, lr_zero)
    assert rules["loss_decreased"].status == FAIL and verdict.decision == "NO-GO"
    assert "not learning" in rules["loss_decreased"].figure


def test_loss_decreased_judges_the_drop_against_the_loss_noise(tmp_path):
    def within_noise(run):  # 2.9% lower at the end, above the 1% floor, but the windows scatter by +-0.2
        run.loss = lambda step: 3.0 - 0.003 * step + 0.2 * _noise(step)
    _, rules = _verdict(tmp_path / "noisy", within_noise)
    figure = rules["loss_decreased"].figure
    assert rules["loss_decreased"].status == FAIL and "(+2.92% drop)" in figure and "drop = 0.5 sigma" in figure

    def clear(run):  # the same noise on a real descent
        run.loss = lambda step: 2.0 + 5.0 * math.exp(-step / 20.0) + 0.3 * _noise(step)
    _, rules = _verdict(tmp_path / "clear", clear)
    assert rules["loss_decreased"].status == PASS


def test_val_tracks_train_fails_when_val_diverges(tmp_path):
    def change(run):
        run.val_loss = lambda step: 2.0 + step / 20.0  # rises while training loss falls
    _, rules = _verdict(tmp_path, change)
    assert rules["val_tracks_train"].status == FAIL
    def widening(run):
        run.val_loss = lambda step: 3.0  # flat while training loss keeps falling: the gap widens
    _, rules = _verdict(tmp_path / "gap", widening)
    assert rules["val_tracks_train"].status == FAIL and "last val +0.0% vs best" in rules["val_tracks_train"].figure
    _, rules = _verdict(tmp_path / "none", eval_every=0)
    assert rules["val_tracks_train"].status == WARN


def test_grad_spikes_repeated_fail_single_warns(tmp_path):
    def repeated(run):
        run.grad_norm = lambda step: 20.0 if step in (40, 50) else 1.0
    _, rules = _verdict(tmp_path / "two", repeated)
    assert rules["grad_spikes"].status == FAIL
    assert "2 spike(s): step 40: 20" in rules["grad_spikes"].figure

    def single(run):
        run.grad_norm = lambda step: 20.0 if step == 40 else 1.0
    _, rules = _verdict(tmp_path / "one", single)
    assert rules["grad_spikes"].status == WARN


def test_clip_rate_fails_when_most_late_updates_clip(tmp_path):
    def change(run):
        run.clipped = lambda step: step % 4 != 0
    _, rules = _verdict(tmp_path, change)
    assert rules["clip_rate"].status == FAIL
    assert "22 of 30 applied updates clipped" in rules["clip_rate"].figure
    # The threshold is configurable.
    _, rules = _verdict(tmp_path / "loose", change, parse_thresholds(["max_clip_rate=0.9"]))
    assert rules["clip_rate"].status == PASS


def test_skip_rate_fails_with_many_overflows(tmp_path):
    def change(run):
        run.overflow_at = set(range(40, 48))
    verdict, rules = _verdict(tmp_path, change)
    assert verdict.summary.valid, verdict.summary.reasons
    assert rules["skip_rate"].status == FAIL
    assert "8 of 68 updates skipped" in rules["skip_rate"].figure


def test_throughput_steady_fails_when_it_decays(tmp_path):
    def change(run):  # the run itself slows: its CPU seconds per token grow with the wall time
        run.train_seconds_per_update = lambda step: 0.5 * (1 + step / 10.0)
        run.cpu_seconds_per_update = lambda step: 0.45 * (1 + step / 10.0)
    _, rules = _verdict(tmp_path, change)
    assert rules["throughput_steady"].status == FAIL and "the run itself slowed" in rules["throughput_steady"].figure


def _busier_machine(run):
    """Training seconds per update quadruple from update 40 on while the process's CPU seconds stay."""
    run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5


def test_throughput_steady_warns_when_only_the_machine_got_busier(tmp_path):
    verdict, rules = _verdict(tmp_path, _busier_machine)
    rule = rules["throughput_steady"]
    assert rule.status == WARN and verdict.decision == "GO"
    assert rule.figure.startswith("the machine got busier") and "(ratio 0.25)" in rule.figure
    assert "(ratio 1.00)" in rule.figure  # tokens per CPU second held
    assert [w.name for w in verdict.warnings] == ["throughput_steady"]


def test_throughput_warns_when_the_process_lost_its_cpu_share_even_if_each_token_cost_more(tmp_path):
    """Two competing processes on the trainer's core: it gets a third of the CPU per training second, and each
    token also costs it more CPU time (every switch evicts its caches). Neither figure alone acquits the recipe,
    but the lost share says other load took the CPU: a WARN naming both, not a FAIL."""
    def shared_core(run):
        run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5
        run.cpu_seconds_per_update = lambda step: 0.9 if step > 40 else 0.45  # twice the CPU per token, half the share
    verdict, rules = _verdict(tmp_path, shared_core)
    rule = rules["throughput_steady"]
    assert rule.status == WARN and verdict.decision == "GO", rule.figure
    assert rule.figure.startswith("the machine got busier") and "(ratio 0.25)" in rule.figure
    assert "tok (ratio 0.50)" in rule.figure and "the process got 0.50 of its share of the CPU" in rule.figure
    assert "judge the recipe's own speed on a quiet machine" in rule.figure


def test_throughput_fails_when_the_share_held_and_each_token_cost_more(tmp_path):
    def slower_recipe(run):  # the CPU share stays at 0.9 while each update takes four times the CPU and the wall
        run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5
        run.cpu_seconds_per_update = lambda step: 1.8 if step > 40 else 0.45
    _, rules = _verdict(tmp_path, slower_recipe)
    rule = rules["throughput_steady"]
    assert rule.status == FAIL and "the run itself slowed" in rule.figure, rule.figure


def test_text_verdict_prints_each_warning_under_the_go_line(tmp_path):
    verdict, rules = _verdict(tmp_path, _busier_machine)
    lines = format_verdict(verdict).splitlines()
    at = lines.index("VERDICT: GO")
    assert lines[at + 1] == f"  WARN throughput_steady: {rules['throughput_steady'].figure}"
    assert lines[at + 2] == verdict.statement and "(warnings: throughput_steady)" in verdict.statement


def test_throughput_contention_is_not_inferred_without_cpu_time_or_on_cuda(tmp_path):
    def build(name):
        return crashed_and_resumed(tmp_path / name, make_run=lambda d, **kw: _with(SyntheticRun(d, **kw),
                                                                                  _busier_machine))
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


def test_throughput_on_cuda_tells_a_busier_machine_by_the_device_seconds(tmp_path):
    """On CUDA each window records the device seconds of its updates (timing events): when the wall time grew but
    the device did the same work per token, the machine got busier (WARN); when the device seconds grew with
    it, the run slowed (FAIL)."""
    def build(name, device_seconds_per_update):
        run = crashed_and_resumed(tmp_path / name, make_run=lambda d, **kw: _with(SyntheticRun(d, **kw),
                                                                                  _busier_machine))
        for session in run.run["sessions"]:
            session["hardware"]["device"] = "cuda"
        for event in run.events:
            if event["event"] == "train":
                window = event["window"]
                window["device_seconds"] = window["updates_attempted"] * device_seconds_per_update(event["step"])
        run.write()
        return {r.name: r for r in judge_summary(summarize_run(run.run_dir)).rules}["throughput_steady"]

    held = build("held", lambda step: 0.3)
    assert held.status == WARN and held.figure.startswith("the machine got busier")
    assert "per device second" in held.figure and "tokens per device second) held" in held.figure
    grew = build("grew", lambda step: 1.2 if step > 40 else 0.3)
    assert grew.status == FAIL and "the run itself slowed" in grew.figure


def _with(run, change):
    change(run)
    return run


def test_memory_fails_on_growth_and_on_budget(tmp_path):
    def leak(run):
        run.rss_mb = lambda step: 500.0 + 40.0 * step
    _, rules = _verdict(tmp_path / "leak", leak)
    assert rules["memory"].status == FAIL and "growth" in rules["memory"].figure
    _, rules = _verdict(tmp_path / "budget", memory_budget_gb=0.25)  # 256 MB < 500 MB peak
    assert rules["memory"].status == FAIL and "peak <= 0.25 GB" in rules["memory"].threshold
    _, rules = _verdict(tmp_path / "fits", memory_budget_gb=1.0)
    assert rules["memory"].status == PASS


def test_experts_fail_on_dead_expert_and_on_imbalance(tmp_path):
    def dead(run):
        run.tokens_per_expert = lambda step, layer: [100.0, 100.0, 100.0, 0.0 if layer == 1 else 100.0]
    _, rules = _verdict(tmp_path / "dead", dead)
    assert rules["experts"].status == FAIL and rules["experts"].figure.startswith("1 dead expert")

    def skewed(run):
        run.tokens_per_expert = lambda step, layer: [300.0, 50.0, 25.0, 25.0]
    _, rules = _verdict(tmp_path / "skew", skewed)
    assert rules["experts"].status == FAIL and "3.00" in rules["experts"].figure


def test_qk_clip_fails_when_it_intervenes_on_most_updates(tmp_path):
    def change(run):
        run.qk_clip_updates = lambda step: 1 if step % 5 else 0
    _, rules = _verdict(tmp_path, change)
    assert rules["qk_clip"].status == FAIL
    assert "48 of 60 applied updates" in rules["qk_clip"].figure  # cumulative, restored at the resume


def test_qk_clip_figure_names_the_first_clip_event(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(20)
    run.end_session()
    run.clip_head(10, 2, 1, 250.0, first_time=True)
    run.clip_head(15, 0, 0, 130.0, first_time=True)
    run.write()
    rule = QK_CLIP.apply(summarize_run(tmp_path / "r"), Thresholds())
    assert "first clip at step 10 (layer 2, head 1, max logit 250)" in rule.figure


def test_resumed_fails_without_resume_unless_waived(tmp_path):
    def straight(builder, run_dir, **kw):
        run = builder(run_dir, **kw)
        run.start_session()
        run.train_until(run.max_steps)
        run.end_session()
        return run
    verdict, rules = _verdict(tmp_path / "a", build=straight)
    assert rules["resumed"].status == FAIL and verdict.decision == "NO-GO"
    verdict, rules = _verdict(tmp_path / "b", build=straight, thresholds=Thresholds(resume_required=False))
    assert rules["resumed"].status == WARN and verdict.decision == "GO"


def test_resumed_fails_when_a_replayed_window_differs(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s1", step=25)["loss"] += 1e-12  # the rolled-back window before the kill
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"))
    rule = {r.name: r for r in verdict.rules}["resumed"]
    assert rule.status == FAIL and "train step 25 loss" in rule.figure


def test_threshold_overrides_are_typed_and_checked():
    t = parse_thresholds(["max_grad_spikes=3", "spike_factor=2.5", "resume_required=false"])
    assert (t.max_grad_spikes, t.spike_factor, t.resume_required) == (3, 2.5, False)
    with pytest.raises(ThresholdError, match="unknown name 'nope'"):
        parse_thresholds(["nope=1"])
    with pytest.raises(ThresholdError, match="max_grad_spikes: 'x' is not a valid int"):
        parse_thresholds(["max_grad_spikes=x"])
    with pytest.raises(ThresholdError, match="expects NAME=VALUE"):
        parse_thresholds(["max_grad_spikes"])


def test_cli_verdict_go_nogo_json_and_bad_threshold(tmp_path, capsys):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert main(["verdict", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "VERDICT: GO" in out and f"report: {tmp_path / 'r' / 'report' / 'report.html'}" in out
    # (A WARN does not block: see test_resumed_fails_without_resume_unless_waived.) A 2x throughput bound fails.
    assert main(["verdict", str(tmp_path / "r"), "--json", "--threshold", "min_throughput_ratio=2"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["decision"] == "NO-GO" and data["thresholds"]["min_throughput_ratio"] == 2.0
    assert {r["name"]: r["status"] for r in data["rules"]}["throughput_steady"] == FAIL
    assert main(["verdict", str(tmp_path / "r"), "--threshold", "bogus=1"]) == 2
    assert "unknown name 'bogus'" in capsys.readouterr().err


def test_resume_with_nothing_left_to_do_is_not_resume_evidence(tmp_path):
    def finished_then_resumed(builder, run_dir, **kw):
        run = builder(run_dir, **kw)
        run.start_session()
        run.train_until(run.max_steps)
        run.end_session()
        run.resume()  # from the final checkpoint: zero updates left
        run.end_session()
        return run
    verdict, rules = _verdict(tmp_path, build=finished_then_resumed)
    assert verdict.summary.valid, verdict.summary.reasons
    assert verdict.summary.overall["resumes"] == 1
    assert rules["resumed"].status == FAIL and verdict.decision == "NO-GO"
    assert "no update applied after any of them" in rules["resumed"].figure


def test_run_json_without_its_recipe_is_invalid_not_defaulted(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    del run.run["recipe"]
    run.write()
    verdict = judge(tmp_path / "r")
    rules = {r.name: r for r in verdict.rules}
    assert verdict.decision == "NO-GO" and not verdict.summary.valid
    assert any("lacks recipe.optim.grad_clip" in reason for reason in verdict.summary.reasons)
    assert rules["record_valid"].status == FAIL
    for name in ("clip_rate", "memory", "qk_clip"):
        assert rules[name].status == FAIL and "lacks" in rules[name].figure


def test_recipe_change_on_resume_is_named_with_its_step_and_the_supported_recipe(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.run["allowed_changes"].append({"session_id": "s2", "key": "optim.muon.lr", "old": 0.003, "new": 0.001})
    run.run["allowed_changes"].append({"session_id": "gone", "key": "optim.adamw.lr", "old": 1, "new": 2})
    run.write()
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["recipe_changes"]
    assert verdict.decision == "GO" and rule.status == WARN
    # Session s2 resumed from checkpoint 20: its first update, 21, ran the new value.
    assert "1 change(s) on resume: optim.muon.lr 0.003 -> 0.001 from update 21" in rule.figure
    assert "over updates 21..60 (40 of 60)" in rule.figure
    data = verdict.to_dict()
    assert data["candidate"]["supported_from_update"] == 21
    assert data["candidate"]["changes"] == [{"key": "optim.muon.lr", "old": 0.003, "new": 0.001,
                                             "session_id": "s2", "from_update": 21}]
    assert [w["name"] for w in data["warnings"]] == ["recipe_changes"]


def test_final_checkpoint_damaged_or_missing_fails_can_continue(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert {r.name: r for r in judge(tmp_path / "r").rules}["final_checkpoint"].status == PASS
    damaged = tmp_path / "r" / "checkpoints" / "step-00000060" / "state.pt"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"!")  # same size, other bytes
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["final_checkpoint"]
    assert rule.status == FAIL and verdict.decision == "NO-GO"
    assert f"{damaged}: sha256 differs" in rule.figure
    for path in damaged.parent.iterdir():
        path.unlink()
    damaged.parent.rmdir()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["final_checkpoint"]
    assert rule.status == FAIL and "no checkpoint folder" in rule.figure and "newest committed: step 40" in rule.figure


def test_missing_evidence_fails_the_rule_that_needs_it(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    for event in run.events:
        event.pop("memory", None)
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["memory"]
    assert rule.status == FAIL and "memory not recorded" in rule.figure


def test_cli_verdict_json_lists_warnings_and_the_candidate(tmp_path, capsys):
    run = crashed_and_resumed(tmp_path / "r", make_run=lambda d, **kw: _with(SyntheticRun(d, **kw), _busier_machine))
    run.write()
    assert main(["verdict", str(tmp_path / "r"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decision"] == "GO" and data["failed"] == []
    assert [w["name"] for w in data["warnings"]] == ["throughput_steady"]
    assert data["warnings"][0]["figure"].startswith("the machine got busier")
    assert len(data["candidate"]["recipe_sha256"]) == 64 and data["frozen"] is None


def test_replayed_windows_under_a_changed_recipe_are_not_compared(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s1", step=25)["loss"] += 0.5  # the new recipe computes other figures
    run.run["allowed_changes"].append({"session_id": "s2", "key": "optim.grad_clip", "old": 1.0, "new": 0.5})
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["resumed"]
    assert rule.status == PASS and "no replayed window to compare; 3 replayed under a changed recipe" in rule.figure


def test_recipe_change_that_did_not_reach_the_optimizer_fails(tmp_path):
    """run.json says Muon's LR became 0.001 from update 21, but the windows' lr / lr_multiplier (the base LR the
    optimizer used) stayed at 0.003: the recorded recipe is not what ran."""
    run = crashed_and_resumed(tmp_path / "r")
    run.run["optimizer"]["groups"] = [{"group": "attention", "optimizer": "muon", "lr": 0.001}]
    run.run["recipe"]["optim"]["muon"] = {"lr": 0.001}
    run.run["allowed_changes"].append({"session_id": "s2", "key": "optim.muon.lr", "old": 0.003, "new": 0.001})
    for event in run.events:
        if event["event"] == "train":
            event["lr"], event["lr_multiplier"] = 0.003 * 0.5, 0.5
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["recipe_changes"]
    assert rule.status == FAIL and "ran a peak LR of 0.003 in group attention (muon)" in rule.figure
    for event in run.events:
        if event["event"] == "train" and event["session_id"] == "s2":
            event["lr"] = 0.001 * 0.5
    run.write()
    assert {r.name: r for r in judge(tmp_path / "r").rules}["recipe_changes"].status == WARN
