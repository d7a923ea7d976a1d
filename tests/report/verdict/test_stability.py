"""stability.py: each judge of whether the loss behaves has a PASS case (the healthy synthetic pilot, in
test_verdict.py) and a FAIL or WARN case built from a small change."""

import math

import pytest

from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.rules import QK_CLIP, RULES_BY_NAME
from pilotrun.report.verdict.stability import loss_noise
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Thresholds, parse_thresholds
from tests.report.synthetic import SyntheticRun, verdict_of


def _noise(step):
    """A deterministic stand-in for batch-to-batch loss noise, in [-1, 1]."""
    return math.sin(step * 12.9898) * 43758.5453 % 2 - 1


def test_losses_finite_fails_on_nan_val_loss(tmp_path):
    def change(run):
        run.val_loss = lambda step: math.nan if step == 50 else 2.5
    _, rules = verdict_of(tmp_path, change)
    assert rules["losses_finite"].status == FAIL
    assert "val loss nan at step 50" in rules["losses_finite"].figure


def test_loss_decreased_fails_when_flat_and_warns_when_small(tmp_path):
    def flat(run):
        run.loss = lambda step: 3.0
    _, rules = verdict_of(tmp_path / "flat", flat)
    assert rules["loss_decreased"].status == FAIL
    assert (
        rules["loss_decreased"].figure.startswith("not learning")
        and "+0.00% drop" in rules["loss_decreased"].figure
    )

    def small(run):
        run.loss = lambda step: 3.0 - 0.001 * step  # a real (noise-free) drop of 1.6%: learning, slowly
    _, rules = verdict_of(tmp_path / "small", small)
    assert rules["loss_decreased"].status == WARN


def test_loss_decreased_fails_a_drop_of_a_tenth_of_a_percent_like_an_lr_of_zero(tmp_path):
    def lr_zero(run):
        run.loss = lambda step: 3.0 - 0.00005 * step + 0.02 * _noise(step)
    verdict, rules = verdict_of(tmp_path, lr_zero)
    assert rules["loss_decreased"].status == FAIL and verdict.decision == "NO-GO"
    assert "not learning" in rules["loss_decreased"].figure


def test_loss_decreased_judges_the_drop_against_the_loss_noise(tmp_path):
    def within_noise(run):  # 2.9% lower at the end, above the 1% floor, but the windows scatter by +-0.2
        run.loss = lambda step: 3.0 - 0.003 * step + 0.2 * _noise(step)
    _, rules = verdict_of(tmp_path / "noisy", within_noise)
    figure = rules["loss_decreased"].figure
    assert (
        rules["loss_decreased"].status == FAIL and "(+2.92% drop)" in figure and "drop = 0.5 sigma" in figure
    )

    def clear(run):  # the same noise on a real descent
        run.loss = lambda step: 2.0 + 5.0 * math.exp(-step / 20.0) + 0.3 * _noise(step)
    _, rules = verdict_of(tmp_path / "clear", clear)
    assert rules["loss_decreased"].status == PASS


def test_val_tracks_train_fails_when_val_diverges(tmp_path):
    def change(run):
        run.val_loss = lambda step: 2.0 + step / 20.0  # rises while training loss falls
    _, rules = verdict_of(tmp_path, change)
    assert rules["val_tracks_train"].status == FAIL
    def widening(run):
        run.val_loss = lambda step: 3.0  # flat while training loss keeps falling: the gap widens
    _, rules = verdict_of(tmp_path / "gap", widening)
    assert (
        rules["val_tracks_train"].status == FAIL
        and "last val +0.0% vs best" in rules["val_tracks_train"].figure
    )
    _, rules = verdict_of(tmp_path / "none", eval_every=0)
    assert rules["val_tracks_train"].status == WARN


def test_grad_spikes_repeated_fail_single_warns(tmp_path):
    def repeated(run):
        run.grad_norm = lambda step: 20.0 if step in (40, 50) else 1.0
    _, rules = verdict_of(tmp_path / "two", repeated)
    assert rules["grad_spikes"].status == FAIL
    assert "2 spike(s): step 40: 20" in rules["grad_spikes"].figure

    def single(run):
        run.grad_norm = lambda step: 20.0 if step == 40 else 1.0
    _, rules = verdict_of(tmp_path / "one", single)
    assert rules["grad_spikes"].status == WARN


def test_clip_rate_fails_when_most_late_updates_clip(tmp_path):
    def change(run):
        run.clipped = lambda step: step % 4 != 0
    _, rules = verdict_of(tmp_path, change)
    assert rules["clip_rate"].status == FAIL
    assert "22 of 30 applied updates clipped" in rules["clip_rate"].figure
    # The threshold is configurable.
    _, rules = verdict_of(tmp_path / "loose", change, parse_thresholds(["max_clip_rate=0.9"]))
    assert rules["clip_rate"].status == PASS


def test_skip_rate_fails_with_many_overflows(tmp_path):
    def change(run):
        run.overflow_at = set(range(40, 48))
    verdict, rules = verdict_of(tmp_path, change)
    assert verdict.summary.valid, verdict.summary.reasons
    assert rules["skip_rate"].status == FAIL
    assert "8 of 68 updates skipped" in rules["skip_rate"].figure


def test_experts_fail_on_dead_expert_and_on_imbalance(tmp_path):
    def dead(run):
        run.tokens_per_expert = lambda step, layer: [100.0, 100.0, 100.0, 0.0 if layer == 1 else 100.0]
    _, rules = verdict_of(tmp_path / "dead", dead)
    assert rules["experts"].status == FAIL and rules["experts"].figure.startswith("1 dead expert")

    def skewed(run):
        run.tokens_per_expert = lambda step, layer: [300.0, 50.0, 25.0, 25.0]
    _, rules = verdict_of(tmp_path / "skew", skewed)
    assert rules["experts"].status == FAIL and "3.00" in rules["experts"].figure


def test_qk_clip_fails_when_it_intervenes_on_most_updates(tmp_path):
    def change(run):
        run.qk_clip_updates = lambda step: 1 if step % 5 else 0
    _, rules = verdict_of(tmp_path, change)
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


def test_loss_noise_is_the_spread_of_successive_differences_not_the_trend():
    assert loss_noise([3.0, 2.9, 2.8]) is None  # too few windows
    assert loss_noise([3.0 - 0.1 * i for i in range(10)]) == 0.0  # a straight descent has no noise
    wobble = [3.0 + (0.1 if i % 2 else -0.1) for i in range(21)]
    # Twenty differences, ten of +0.2 and ten of -0.2: centred on their median (0) each deviates by 0.2.
    assert loss_noise(wobble) == pytest.approx(1.4826 * 0.2 / math.sqrt(2))


def test_loss_rise_at_end_passes_a_healthy_noisy_run_and_a_noisy_plateau(tmp_path):
    def healthy(run):
        run.loss = lambda step: 2.0 + 5.0 * math.exp(-step / 20.0) + 0.3 * _noise(step)
    _, rules = verdict_of(tmp_path / "healthy", healthy, max_steps=240)
    assert rules["loss_rise_at_end"].status == PASS, rules["loss_rise_at_end"].figure
    assert rules["loss_rise_at_end"].figure.startswith("median train loss") and "sigma of window noise" in \
        rules["loss_rise_at_end"].figure
    # A plateau whose windows scatter by +-0.3 (10% of the loss), one spike near the end among them: a
    # median moves with neither.
    for offset in range(8):
        def plateau(run, offset=offset):
            run.loss = lambda step: 3.0 + 0.3 * _noise(step + 1000 * offset) + (2.0 if step == 230 else 0.0)
        _, rules = verdict_of(tmp_path / f"plateau{offset}", plateau, max_steps=240)
        assert rules["loss_rise_at_end"].status == PASS, rules["loss_rise_at_end"].figure


def test_loss_rise_at_end_fails_a_loss_that_falls_then_climbs_back(tmp_path):
    # falls to update 23, then climbs 0.0015 a step (+0.33 by the end) under +-0.1 of noise
    def fall_then_rise(run):
        run.loss = lambda step: 3.0 + 0.0015 * abs(step - 23) * (1 if step > 23 else 40) + 0.1 * _noise(step)
    verdict, rules = verdict_of(tmp_path, fall_then_rise, max_steps=240)
    found = rules["loss_rise_at_end"]
    assert found.status == FAIL and verdict.decision == "NO-GO", found.figure
    assert found.figure.startswith("the loss rises at the end: median train loss")
    assert "over the last 12 windows (steps 185-240) vs the best 3.0" in found.figure


def test_loss_rise_at_end_needs_both_the_sigmas_and_the_share(tmp_path):
    # noise-free, so far beyond any sigma, but 1% above the best level: a plateau's wander
    def small_rise(run):
        run.loss = lambda step: 3.0 + (0.03 if step > 180 else 0.0)
    _, rules = verdict_of(tmp_path / "small", small_rise, max_steps=240)
    assert rules["loss_rise_at_end"].status == PASS
    strict = parse_thresholds(["min_loss_rise=0.005"])
    _, rules = verdict_of(tmp_path / "strict", small_rise, thresholds=strict, max_steps=240)
    assert rules["loss_rise_at_end"].status == FAIL and "+1.00%" in rules["loss_rise_at_end"].figure


def test_loss_rise_at_end_warns_with_too_few_windows(tmp_path):
    run = SyntheticRun(tmp_path / "r", max_steps=25)
    run.start_session()
    run.train_until(25)  # 5 windows: fewer than 3 at the end and 3 before them
    run.end_session()
    run.write()
    found = RULES_BY_NAME["loss_rise_at_end"].apply(summarize_run(tmp_path / "r"), Thresholds())
    assert found.status == WARN and found.figure.startswith("only 5 finite train window(s)")


def test_grad_spikes_tells_the_trainers_spikes_the_spikes_row_warns_about(tmp_path):
    """The trainer's per-update spikes (the spikes row): one in the loss alone is named beside "no
    gradient-norm spike", never a bare "no spike"; one in the gradient norm that no logged window shows (its
    update skipped) counts as a spike of this row too."""
    def with_spikes(signals):
        def build(builder, run_dir, **kw):
            run = builder(run_dir, **kw)
            run.start_session()
            run.train_until(30)
            run._emit("spike", spike_step=31, signals=signals, loss=7.1, grad_norm=1.2, batches=[30],
                      action="skipped", cause="batch", replay=None)
            run.train_until(run.max_steps)
            run.end_session()
            return run
        return build

    _, rules = verdict_of(tmp_path / "loss", build=with_spikes(["loss"]))
    row = rules["grad_spikes"]
    assert rules["spikes"].status == WARN and "update 31" in rules["spikes"].figure
    assert row.status == PASS and row.figure.startswith("no gradient-norm spike; max grad norm ")
    assert "the trainer's spike(s) at update(s) 31 were in the loss alone (spikes row)" in row.figure
    _, rules = verdict_of(tmp_path / "norm", build=with_spikes(["grad_norm"]))
    row = rules["grad_spikes"]
    assert row.status == WARN and row.figure.startswith("1 spike(s): update 31: 1.2 (the trainer's spike")


@pytest.mark.parametrize(("grad_accum", "multiple"), [(1, 1 + 8 * 0.5 * math.sqrt(8)), (2, 9.0), (8, 5.0)])
def test_grad_spikes_holds_a_window_to_the_detectors_floor_for_its_batch(tmp_path, grad_accum, multiple):
    """64, 128 and 512 tokens per update (4 x 16 tokens a microbatch): the row's floor is the trainer's
    detector's (spikes/bound.grad_norm_floor_share, sqrt(512 / tokens) x 0.5 below 512 tokens), so a norm
    just above that multiple of the median is a spike and one just under it is not."""
    from pilotrun.training.spikes.bound import grad_norm_floor_share

    tokens = 64 * grad_accum
    assert 1 + 8 * grad_norm_floor_share(tokens) == pytest.approx(multiple)
    for factor, status in ((multiple * 1.01, WARN), (multiple * 0.99, PASS)):
        def one(run, value=factor):
            run.grad_norm = lambda step: value if step == 40 else 1.0
        _, rules = verdict_of(tmp_path / f"{factor:.3f}", one, batch_size=4, seq_len=16,
                              grad_accum=grad_accum)
        row = rules["grad_spikes"]
        assert row.status == status, row.figure
        assert row.threshold.endswith(f"(>= {multiple:.3g}x the median)")
