"""Toy task: prompts, the per-character reward, and that a tiny random model learns it."""
import pytest
import torch
from polynya.models import load_model, tiny_token_id, tiny_tokenizer
from polynya.recipes.tasks import get_task, toy

SEVEN = toy.load("train")[7]


def test_prompts():
    train, test = toy.load("train"), toy.load("test")
    assert (len(train), len(test)) == (40, 10)
    assert len({e.prompt for e in train + test}) == 50
    assert all(e.answer in e.prompt and e.meta["target"] == e.answer for e in train + test)
    assert get_task("toy") is toy
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        toy.load("dev")
    with pytest.raises(ValueError, match="source must be None"):
        toy.load("train", source="digits.jsonl")


@pytest.mark.parametrize("completion,expected", [
    ("7" * 16, 1.0),
    ("7" * 40, 1.0),                     # only the first 16 characters count
    ("1" * 16, 0.25),                    # other digits: partial
    ("7 7 7 7", 4 / 16),                 # short completions score less
    ("abc 7", 1 / 16),
    ("x" * 16 + "7777", 0.0),
    ("", 0.0),
    ("٧" * 16, 0.0),                     # non-ASCII digits do not count
])
def test_reward(completion, expected):
    assert SEVEN.answer == "7"
    assert toy.reward(completion, SEVEN) == pytest.approx(expected)
    with pytest.raises(ValueError, match="window must be positive"):
        toy.reward("7", SEVEN, window=0)


def _grpo_rewards(steps: int, seed: int = 0, lr: float = 1e-2, prompts: int = 8, group: int = 8,
                  max_tokens: int = 8) -> list[float]:
    """A minimal on-policy GRPO loop (sample G per prompt, group-normalised advantages,
    token-level policy gradient) on tiny:qwen3; returns the mean reward of every step."""
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    model = load_model("tiny:qwen3", seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    examples, gen = toy.load("train"), torch.Generator().manual_seed(seed)
    eos, pad = tiny_token_id("<|endoftext|>"), tiny_token_id("<|pad|>")
    history = []
    for _ in range(steps):
        order = torch.randperm(len(examples), generator=gen)[:prompts].tolist()
        batch = [examples[i] for i in order for _ in range(group)]
        enc = tok([e.prompt for e in batch], return_tensors="pt", padding=True)
        plen = enc.input_ids.shape[1]
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, max_new_tokens=max_tokens, top_k=0,
                                 top_p=1.0, temperature=1.0, pad_token_id=pad, eos_token_id=eos)
        resp = out[:, plen:]
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        rewards = torch.tensor([toy.reward(t, e) for t, e in zip(texts, batch, strict=True)])
        rewards = rewards.view(prompts, group)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4))
        seen_eos = (resp == eos).long().cumsum(1)
        mask = ((seen_eos == 0) | ((seen_eos == 1) & (resp == eos))).float()  # up to first eos
        attn = torch.cat([enc.attention_mask, mask.long()], 1)
        logits = model(input_ids=out, attention_mask=attn).logits[:, plen - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        loss = -(logp * adv.view(-1, 1) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(rewards.mean().item())
    return history


def test_tiny_random_model_learns_the_toy_task_in_20_grpo_steps():
    """Seed 0, lr 1e-2, 8 prompts x 8 samples: reward goes from ~0.03 to ~0.2 (seen: seeds 0-3)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny matrices: one thread is fastest on a shared CPU
    try:
        rewards = _grpo_rewards(steps=20)
    finally:
        torch.set_num_threads(threads)
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert start < 0.08                   # random init writes few digits
    assert end > start + 0.06 and end > 2.5 * start, rewards
