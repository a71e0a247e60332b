"""A reward never ends a run: a completion that cannot be judged is counted in the step's
``reward_errors`` and trains with advantage 0, left out of its group's statistics (issue 16: one
sampled token decoding to NUL made ``sqlite3.complete_statement`` raise inside the Txt2SQL reward
and killed the GRPO run); in evaluation it scores 0."""

import math

import polynya
import pytest
from hydra import compose, initialize_config_module
from polynya.models import load_tokenizer
from polynya.recipes.driver import GRPODriver
from polynya.recipes.schema import register
from polynya.recipes.tasks import txt2sql
from polynya.recipes.tasks.sqlsafe import QueryError, single_statement

register()


def test_nul_token_in_sql_scores_zero():
    tok = load_tokenizer("tiny:qwen3")
    nul = next(i for i in range(1000) if "\x00" in tok.decode([i]))
    ex = txt2sql.load("train")[0]
    good = f"```sql\n{ex.answer}\n```"
    assert txt2sql.reward(good, ex) == 1.0
    bad = tok.decode(tok.encode(good[:-4], add_special_tokens=False) + [nul]) + "\n```"
    assert "\x00" in bad
    assert txt2sql.reward(bad, ex) == 0.0
    with pytest.raises(QueryError, match="NUL"):
        single_statement("SELECT 1\x00")


class _Flaky:
    """A task whose reward fails on every third completion (and returns NaN on every fifth)."""

    def __init__(self, task):
        self.task, self.calls, self.failed = task, 0, 0

    def reward(self, completion, example, **kw):
        self.calls += 1
        if self.calls % 3 == 0:
            self.failed += 1
            raise ValueError("the statement contains a null character.")
        if self.calls % 5 == 0:
            self.failed += 1
            return math.nan
        return 1.0 + 0.1 * (self.calls % 2)


def test_failing_reward_is_left_out_and_counted(tmp_path):
    with initialize_config_module("polynya.recipes.conf", version_base=None):
        cfg = compose(
            "config",
            overrides=[
                "task=toy",
                f"run.out_dir={tmp_path}",
                "run.group_size=4",
                "run.prompts_per_step=2",
                "run.max_new_tokens=3",
                "run.progress=false",
            ],
        )
    driver = GRPODriver(cfg)
    driver.task = _Flaky(driver.task)
    with polynya.create_rl_client(driver.client_config) as client:
        metrics = driver.step(client, 0)
    assert driver.task.calls == 8 and driver.task.failed == 3  # calls 3, 5, 6
    assert metrics["reward_errors"] == 3
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    # judged: calls 1, 7 -> 1.1; 2, 4, 8 -> 1.0; calls 3, 5, 6 are left out (not scored 0)
    assert metrics["reward_max"] == pytest.approx(1.1)
    assert metrics["reward_mean"] == pytest.approx((2 * 1.1 + 3 * 1.0) / 5, rel=1e-6)


def test_evaluator_scores_unjudgeable_completions_zero():
    from polynya.recipes.evaluate import Evaluator
    from polynya.recipes.tasks import toy

    class _Client:  # what evaluate() needs of a client: generate
        def generate(self, prompts, params):
            return [[polynya.Sample([5, 6], None, "length")] for _ in prompts]

    examples = toy.load("test")[:6]
    ev = Evaluator(_Flaky(toy), examples, [[5, 6, 7]] * len(examples),
                   tokenizer=load_tokenizer("tiny:qwen3"), reward_kwargs={}, max_new_tokens=2,
                   greedy=True, temperature=1.0, seed=0)
    out = ev.evaluate(_Client(), 0)
    assert out["eval_reward_errors"] == 3 and out["eval_examples"] == 6  # calls 3, 5, 6
    assert out["eval_reward_mean"] == pytest.approx((1.1 + 1.0 + 1.0) / 6)


@pytest.mark.parametrize("score,format_score", [(1.0, 0.0), (0.5, 0.0), (2.0, 1.0)])
def test_eval_pass_at_1_counts_the_tasks_full_score(score, format_score):
    """Review 2026-12: pass@1 counted rewards >= 1.0, so with gsm8k's ``task.reward.score=0.5``
    no correct answer passed, and with ``score=2, format_score=1`` every wrong one did."""
    from polynya.recipes.evaluate import Evaluator
    from polynya.recipes.tasks import Example, gsm8k

    texts = ["#### 72", "#### 71", "no answer", "so\n#### 72"]

    class _Tokenizer:  # token id k decodes to texts[k]
        def decode(self, ids, skip_special_tokens):
            return texts[ids[0]]

    class _Client:
        def generate(self, prompts, params):
            return [[polynya.Sample([k], None, "stop")] for k in range(len(prompts))]

    examples = [Example("q", "72")] * len(texts)
    ev = Evaluator(gsm8k, examples, [[1]] * len(texts), tokenizer=_Tokenizer(),
                   reward_kwargs={"score": score, "format_score": format_score},
                   max_new_tokens=4, greedy=True, temperature=1.0, seed=0)
    out = ev.evaluate(_Client(), 0)
    assert out["eval_pass_at_1"] == 0.5
    assert out["eval_reward_mean"] == pytest.approx((2 * score + format_score) / 4)
