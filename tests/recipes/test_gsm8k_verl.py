"""GSM8K reward parity with stock verl: ``convention="verl"`` (the default) gives exactly verl
0.9.1's ``compute_score`` on the hand-written cases, both extraction methods and format scores.
Runs in the verl environment (``tests/envs/verl``); skipped where verl is not importable."""
import pytest
from polynya.recipes.tasks import Example, gsm8k

from test_gsm8k import CASES  # tests/recipes is not a package: pytest puts it on sys.path


def test_matches_verl_compute_score():
    scorer = pytest.importorskip("verl.utils.reward_score.gsm8k")
    flexible = [(c, t) for c, t, _, _ in CASES] + [("It costs $72 or 7,2", "72"), ("1.5. then .", "1.5")]
    for method in ("strict", "flexible"):
        for completion, truth in flexible:
            for fmt in (0.0, 0.1):
                want = scorer.compute_score(completion, truth, method=method, format_score=fmt)
                got = gsm8k.reward(completion, Example("q", truth), method=method, format_score=fmt)
                assert got == want, (method, completion, truth)
