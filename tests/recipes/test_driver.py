"""The built-in GRPO driver's reward and advantage path: ``group_advantages`` against a plain
Python reference on fresh random rewards, groups with equal rewards exactly 0, the population std
(verl and TRL use the sample std), unjudgeable completions left out of their groups, truncated
completions scored as any other, and the run settings that would train nothing refused."""
import math
import random
import statistics

import polynya
import pytest
import torch
from hydra import compose, initialize_config_module
from polynya.models import load_tokenizer
from polynya.recipes.driver import GRPODriver, group_advantages
from polynya.recipes.schema import register
from polynya.recipes.tasks import toy

register()


def _reference(rewards: list[float], judged: list[bool], g: int, scale: bool, eps: float) -> list[float]:
    """GRPO advantages written out per group in Python floats (population std)."""
    out = []
    for k in range(0, len(rewards), g):
        vals = [r for r, ok in zip(rewards[k:k + g], judged[k:k + g]) if ok]
        mean = statistics.fmean(vals) if vals else 0.0
        std = statistics.pstdev(vals) if len(vals) > 1 else 0.0
        flat = len(vals) < 2 or max(vals) == min(vals)
        for r, ok in zip(rewards[k:k + g], judged[k:k + g]):
            if not ok or flat:
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if scale else r - mean)
    return out


@pytest.mark.parametrize("g", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_the_reference_on_random_rewards(g, scale):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    prompts = rng.randint(1, 7)
    kinds = [lambda: rng.random(), lambda: float(rng.random() < 0.4),        # dense, binary
             lambda: rng.choice([0.0, 0.1, 1.0]), lambda: rng.gauss(0, 50)]  # partial credit
    rewards, judged = [], []
    for _ in range(prompts):
        draw = rng.choice(kinds)
        rewards += [draw() for _ in range(g)]
        judged += [rng.random() > 0.2 for _ in range(g)]
    rewards_t = torch.tensor([r if ok else math.nan for r, ok in zip(rewards, judged)],
                             dtype=torch.float64)
    eps = rng.choice([0.0, 1e-6, 1e-4])
    got = group_advantages(rewards_t, g, scale=scale, eps=eps, judged=torch.tensor(judged))
    want = torch.tensor(_reference(rewards, judged, g, scale, eps))
    assert got.dtype == torch.float32 and got.shape == (prompts * g,)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
    assert torch.equal(got[~torch.tensor(judged)], torch.zeros(int((~torch.tensor(judged)).sum())))


@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3, 0.7, 1.1, -2.5, 0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_groups_with_equal_rewards_get_exactly_zero(value, dtype):
    """Audit 2026-12-07: a float32 mean of eight 0.3s is not 0.3; divided by 0 + 1e-6 the
    rounding gave every sample of the group -0.029 (0.056 for 0.7)."""
    r = torch.tensor([value] * 8 + [0.0, 1.0] * 4, dtype=dtype)
    for scale in (True, False):
        adv = group_advantages(r, 8, scale=scale, eps=1e-6)
        assert torch.equal(adv[:8], torch.zeros(8)), (value, scale)
        assert torch.allclose(adv[8:], torch.tensor([-1.0, 1.0] * 4) * (1 if scale else 0.5),
                              atol=1e-5)


def test_population_std_and_what_verl_and_trl_give():
    """Polynya divides by the population std; verl's compute_grpo_outcome_advantage
    (``torch.std``) and TRL's GRPOTrainer (``.std()`` / ``nanstd``) by the sample std, so
    polynya's are ``sqrt(G / (G - 1))`` times theirs (eps 0)."""
    torch.manual_seed(random.randrange(2**31))
    for g in (2, 5, 8):
        r = torch.rand(6, g, dtype=torch.float64)
        ours = group_advantages(r.flatten(), g, scale=True, eps=0.0).view(6, g).double()
        theirs = (r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True)  # unbiased, as verl/TRL
        torch.testing.assert_close(ours, theirs * math.sqrt(g / (g - 1)), rtol=1e-5, atol=1e-6)
        assert torch.allclose(ours.pow(2).mean(1), torch.ones(6, dtype=torch.float64), atol=1e-5)


def test_small_groups_and_bad_inputs():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1, scale=True, eps=1e-6),
                       torch.zeros(2))  # a group of one: 0 (verl would give the raw reward)
    one_judged = group_advantages(torch.tensor([1.0, math.nan, 0.0, 1.0]), 2, scale=True, eps=1e-6,
                                  judged=torch.tensor([True, False, True, True]))
    torch.testing.assert_close(one_judged, torch.tensor([0.0, 0.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(torch.zeros(4), 3, scale=True, eps=1e-6)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2, scale=True, eps=1e-6)
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        group_advantages(torch.zeros(2), 0, scale=True, eps=1e-6)
    for eps in (-1e-6, math.nan, math.inf):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            group_advantages(torch.zeros(2), 2, scale=True, eps=eps)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="sample 3 \\(group 1\\) is not finite"):
            group_advantages(torch.tensor([0.0, 1.0, 0.5, bad]), 2, scale=True, eps=1e-6)
    with pytest.raises(ValueError, match="judged must be a bool tensor"):
        group_advantages(torch.zeros(2), 2, scale=True, eps=1e-6, judged=torch.ones(2))


def _compose(*overrides):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        return compose("config", overrides=["task=toy", "run.progress=false", *overrides])


@pytest.mark.parametrize("override, message", [
    ("run.group_size=1", "run.group_size must be >= 2"),
    ("run.advantage_eps=-1e-6", "run.advantage_eps must be a finite number >= 0"),
    ("run.advantage_eps=nan", "run.advantage_eps must be a finite number >= 0"),
])
def test_run_settings_that_train_nothing_or_break_the_advantages_are_refused(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        GRPODriver(_compose(f"run.out_dir={tmp_path}", override))


class _Client:
    """What ``GRPODriver.step`` needs of a client, recording the batch it trains on."""

    def __init__(self, samples_per_prompt):
        self.samples_per_prompt, self.batch = samples_per_prompt, None

    def generate(self, prompts, params):
        return [list(self.samples_per_prompt(k)) for k in range(len(prompts))]

    def forward_backward(self, batch):
        self.batch = batch
        return {"loss": 0.5}

    def step(self):
        return {"grad_norm": 1.0}

    def sync_weights(self):
        pass


class _Flaky:
    """A toy-like task whose reward raises on every third call and is NaN / inf on every fifth /
    seventh; otherwise 1.0 + 0.1 * (call % 2)."""

    NAME = "flaky"

    def __init__(self):
        self.calls = 0

    def reward(self, completion, example, **kw):
        self.calls += 1
        if self.calls % 3 == 0:
            raise ValueError("cannot judge this")
        if self.calls % 5 == 0:
            return math.nan
        if self.calls % 7 == 0:
            return math.inf
        return 1.0 + 0.1 * (self.calls % 2)


def test_unjudgeable_completions_are_left_out_of_their_groups_and_named(tmp_path, capsys):
    driver = GRPODriver(_compose(f"run.out_dir={tmp_path}", "run.group_size=4", "run.prompts_per_step=2"))
    driver.task = _Flaky()
    client = _Client(lambda k: [polynya.Sample([5, 6], None, "stop")] * 4)
    metrics = driver.step(client, 0)
    # calls 1..8: 3, 6 raise, 5 NaN, 7 inf; judged 1 -> 1.1, 2 -> 1.0, 4 -> 1.0, 8 -> 1.0
    judged = [True, True, False, True, False, False, False, True]
    rewards = [1.1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    want = _reference(rewards, judged, 4, scale=True, eps=1e-6)
    torch.testing.assert_close(client.batch.advantages, torch.tensor(want, dtype=torch.float32))
    assert client.batch.advantages[4:].abs().max() == 0  # group 1: one judged reward
    assert metrics["reward_errors"] == 4
    assert metrics["reward_mean"] == pytest.approx((1.1 + 3 * 1.0) / 4)
    assert metrics["reward_max"] == pytest.approx(1.1)
    out = capsys.readouterr().out
    example = driver.examples[driver._pick(0)[0]]
    assert "step 0: 4 of 8 completions could not be judged" in out
    assert f"({example.prompt.strip()!r})" in out and "ValueError: cannot judge this" in out


def test_a_step_where_nothing_can_be_judged_stops_the_run_naming_the_prompt(tmp_path):
    driver = GRPODriver(_compose(f"run.out_dir={tmp_path}", "run.group_size=2", "run.prompts_per_step=2"))

    class Broken:
        NAME = "broken"

        def reward(self, completion, example, **kw):
            return math.nan

    driver.task = Broken()
    client = _Client(lambda k: [polynya.Sample([5], None, "stop")] * 2)
    with pytest.raises(RuntimeError, match=r"step 3: the toy reward could judge none of the 4 .*"
                                           r"train example \d+ \('.*'\): reward nan is not finite"):
        driver.step(client, 3)
    assert client.batch is None  # nothing trained


def test_truncated_completions_are_scored_as_any_other(tmp_path):
    driver = GRPODriver(_compose(f"run.out_dir={tmp_path}", "run.group_size=4", "run.prompts_per_step=3"))
    tok = load_tokenizer("tiny:qwen3")
    ids = tok.encode(" 7 7 7 1", add_special_tokens=False)
    client = _Client(lambda k: [polynya.Sample(ids, None, "length"), polynya.Sample(ids, None, "stop"),
                                polynya.Sample(ids[:1], None, "length"), polynya.Sample([], None, "stop")])
    metrics = driver.step(client, 0)
    assert metrics["truncated_frac"] == 0.5 and metrics["reward_errors"] == 0
    text = tok.decode(ids, skip_special_tokens=True)
    for k, i in enumerate(driver._pick(0)):
        ex = driver.examples[i]
        want = [toy.reward(text, ex), toy.reward(text, ex), toy.reward(tok.decode(ids[:1]), ex), 0.0]
        torch.testing.assert_close(client.batch.advantages[4 * k:4 * k + 4],
                                   torch.tensor(_reference(want, [True] * 4, 4, True, 1e-6)))


def test_a_group_of_the_wrong_size_is_refused(tmp_path):
    driver = GRPODriver(_compose(f"run.out_dir={tmp_path}", "run.group_size=4", "run.prompts_per_step=2"))
    client = _Client(lambda k: [polynya.Sample([5], None, "stop")] * (3 if k else 4))
    with pytest.raises(RuntimeError, match="generate returned 3 samples for train example .* "
                                           "not run.group_size=4"):
        driver.step(client, 0)
