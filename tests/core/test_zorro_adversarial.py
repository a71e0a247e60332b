"""ZoRRo == naive on adversarial batches: a seeded fuzz over the prefix forest's corner cases.

CPU, fp32, tiny models.

Each case draws a batch from a mix of structures the prefix forest must get right — prompts that
are strict prefixes of other prompts (same and different groups), one prompt under several group
ids, identical responses, a response that is a prefix of another, 1-token prompts and responses,
empty responses, one sequence split at two points (``prompt_a + response_a == prompt_b +
response_b``), a whole sequence that is (a prefix of) another row's prompt, heads shared by
different prompts of ``MIN_SHARED_TOKENS`` +- 1 and of ``FLEX_BLOCK`` / ``LEAF_MULTIPLE`` +- 1
tokens, duplicate rows, very uneven lengths, interleaved groups — and runs it one way of the
engines': one row, rows under a small ``max_tokens_per_row``, or micro-batches of
``plan_micro_batches`` (several data-parallel ranks) each through ``compute_logprobs``, as the
training engine does (micro-batches on a copy in train mode with gradient checkpointing, as the
engine sets it up). The oracle is every row on its own through another copy of the model under
transformers' eager attention (no packing, no padding, no polynya code), log-probs and entropy
taken from its logits; ZoRRo, the packed and the padded naive layouts must equal it in log-probs
and entropy (fp32, 1e-5), row order and shape, and in the gradients of
``sum(logprobs * w) + 0.3 * sum(entropy * w')`` (1e-4 relative, every parameter).
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from polynya import RolloutBatch, compute_logprobs
from polynya.kernels.zorro.plan import LEAF_MULTIPLE
from polynya.models import load_model, model_config
from polynya.zorro import plan_micro_batches
from polynya.zorro.attention import FLEX_BLOCK
from polynya.zorro.tree import MIN_SHARED_TOKENS

# full attention; windows on every layer; windows on every other layer + final soft-cap;
# windows + attention soft-cap; mixture of experts
FAMILIES = ["tiny:qwen3", "tiny:mistral", "tiny:gemma3", "tiny:gemma2", "tiny:qwen3-moe"]
CASES = 60
EDGES = sorted({MIN_SHARED_TOKENS + d for d in (-1, 0, 1)} | {LEAF_MULTIPLE + d for d in (-1, 0, 1)}
               | {FLEX_BLOCK + d for d in (-1, 0, 1)})
_MODELS: dict[str, tuple] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one thread is fastest, and several crawl on a shared CPU (2 cores with
    another job on them: 115 s for this file with 2 threads, 28 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(family: str):
    """Three copies of one model's weights, built once: for polynya's calls (eval mode), as the
    training engine runs it (train mode, gradient checkpointing without re-entry), and under
    transformers' eager attention (the oracle)."""
    if family not in _MODELS:
        model, trained = load_model(family, seed=7), load_model(family, seed=7)
        trained.train()
        with warnings.catch_warnings():  # the engine's call; transformers 5 renames it
            warnings.simplefilter("ignore", FutureWarning)
            trained.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        _MODELS[family] = (model, trained, load_model(family, seed=7, attn_implementation="eager"))
    return _MODELS[family]


def _specials(cfg) -> list[int]:
    """Token ids worth drawing now and then: padding (the packed rows' filler), EOS, the ends."""
    return [t for t in (cfg.pad_token_id, cfg.eos_token_id, 0, cfg.vocab_size - 1) if t is not None]


class _Rows:
    """Rows under construction: (prompt, response, group id)."""

    def __init__(self, rng: random.Random, vocab: int, specials: list[int]):
        self.rng, self.vocab, self.specials = rng, vocab, specials
        self.small = rng.random() < 0.4  # a 3-token alphabet: accidental sharing everywhere
        self.rows: list[tuple[list[int], list[int], int]] = []
        self.gid = 0

    def toks(self, n: int) -> list[int]:
        if self.small:
            return [self.rng.randrange(3) for _ in range(n)]
        return [self.rng.choice(self.specials) if self.rng.random() < 0.05
                else self.rng.randrange(self.vocab) for _ in range(n)]

    def new_gid(self) -> int:
        self.gid += 1
        return self.gid

    def group(self, prompt: list[int], responses: list[list[int]], gid: int | None = None) -> None:
        gid = self.new_gid() if gid is None else gid
        self.rows += [(list(prompt), list(r), gid) for r in responses]

    def responses(self, g: int, lo: int = 1, hi: int = 12) -> list[list[int]]:
        return [self.toks(self.rng.randint(lo, hi)) for _ in range(g)]


def _prefix_prompts(b: _Rows) -> None:
    """A prompt that is a strict prefix of another, in another group or in the same one."""
    long = b.toks(b.rng.randint(3, 40))
    short = long[:b.rng.randint(1, len(long) - 1)]
    gid = b.new_gid()
    b.group(long, b.responses(b.rng.randint(1, 3)), gid)
    b.group(short, b.responses(b.rng.randint(1, 3)), gid if b.rng.random() < 0.5 else None)


def _one_prompt_many_groups(b: _Rows) -> None:
    """One prompt under two or three group ids (merged into one group when ids are absent)."""
    prompt = b.toks(b.rng.randint(1, 30))
    for _ in range(b.rng.randint(2, 3)):
        b.group(prompt, b.responses(b.rng.randint(1, 3)))


def _identical_and_prefix_responses(b: _Rows) -> None:
    """A group whose responses repeat one another, and one that is a prefix of another."""
    r = b.toks(b.rng.randint(2, 16))
    cut = b.rng.randint(1, len(r) - 1)
    b.group(b.toks(b.rng.randint(1, 20)), [r, list(r), r[:cut], r + b.toks(3), r[:1]])


def _one_token(b: _Rows) -> None:
    """1-token prompts with 1-token responses; a 1-token prompt that starts another prompt."""
    t = b.toks(1)
    b.group(t, [b.toks(1) for _ in range(b.rng.randint(1, 3))])
    b.group(t + b.toks(b.rng.randint(1, 6)), [b.toks(1), b.toks(2)])


def _cross_split(b: _Rows) -> None:
    """One token sequence split at several points: equal ``prompt + response``, each row's
    log-probs only over its own response; a whole sequence that is another row's prompt, and one
    that ends inside another row's prompt."""
    s = b.toks(b.rng.randint(4, 40))
    cuts = sorted(b.rng.sample(range(1, len(s)), min(3, len(s) - 1)))
    for c in cuts:
        b.group(s[:c], [s[c:]], None if b.rng.random() < 0.7 else b.gid)
    c = cuts[0]
    b.group(s, b.responses(2))                               # s itself as a prompt
    b.group(s + b.toks(3), [b.toks(2)])                      # s ends inside this prompt
    b.group(s[:c], [s[c:c + b.rng.randint(1, len(s) - c)]])  # a response that s continues


def _shared_heads(b: _Rows) -> None:
    """Two or three prompt groups behind one head of a length around the sharing threshold and
    the kernels' block sizes; some continuations agree for a few more tokens."""
    head = b.toks(b.rng.choice(EDGES))
    common = b.toks(b.rng.randint(0, 3))
    for k in range(b.rng.randint(2, 3)):
        q = (common if k else []) + b.toks(b.rng.randint(0 if k == 0 else 1, 10))
        b.group(head + q, b.responses(b.rng.randint(1, 3)))


def _ends_at_branch(b: _Rows) -> None:
    """Different prompts part after a head (short or around the threshold) where other rows end:
    one's response ends exactly there, one has the head as its prompt and no response."""
    head = b.toks(b.rng.choice([b.rng.randint(1, 70)] + EDGES))
    for _ in range(2):
        b.group(head + b.toks(b.rng.randint(1, 8)), b.responses(b.rng.randint(1, 2)))
    c = b.rng.randint(1, len(head) - 1) if len(head) > 1 else 1
    b.group(head[:c], [head[c:] or b.toks(1)])
    b.group(head, [[]])


def _nested_heads(b: _Rows) -> None:
    """A header, then a system prompt behind it for some groups: nested shared spans each shorter
    than the threshold while together at, below or above it."""
    total = b.rng.choice(EDGES)
    a = b.rng.randint(1, min(total - 1, MIN_SHARED_TOKENS - 1))
    header, system = b.toks(a), b.toks(total - a)
    b.group(header + b.toks(b.rng.randint(1, 6)), b.responses(2))
    b.group(header + system, b.responses(2))
    for _ in range(2):
        b.group(header + system + b.toks(b.rng.randint(1, 6)), b.responses(b.rng.randint(1, 3)))


def _edge_length_group(b: _Rows) -> None:
    """A group whose whole prompt has a length around the threshold / block sizes."""
    b.group(b.toks(b.rng.choice(EDGES)), b.responses(b.rng.randint(2, 4)))


def _uneven(b: _Rows) -> None:
    """A very long response beside 1-token ones, in one group."""
    prompt = b.toks(b.rng.randint(1, 8))
    short = [b.toks(1) for _ in range(b.rng.randint(1, 4))]
    b.group(prompt, [b.toks(b.rng.randint(150, 260))] + short)


def _empty_responses(b: _Rows) -> None:
    """Empty responses, one behind a prompt that other rows continue."""
    p = b.toks(b.rng.randint(1, 12))
    b.group(p, [[], b.toks(3), []])
    b.group(p + b.toks(2), [[]])


INGREDIENTS = [_prefix_prompts, _one_prompt_many_groups, _identical_and_prefix_responses,
               _one_token, _cross_split, _shared_heads, _ends_at_branch, _nested_heads,
               _edge_length_group, _uneven, _empty_responses]


def adversarial_batch(seed: int, vocab: int, specials: list[int]) -> RolloutBatch:
    """A random mix of the ingredients, duplicated rows, rows shuffled (groups interleaved),
    group ids given or (half the time) left to detection by identical prompts; now and then a
    token is one of ``specials`` (padding, EOS, the ends of the vocabulary)."""
    rng = random.Random(seed)
    b = _Rows(rng, vocab, specials)
    for make in rng.sample(INGREDIENTS, rng.randint(3, 6)):
        make(b)
    if rng.random() < 0.5:  # plain GRPO groups beside them
        for _ in range(rng.randint(1, 3)):
            b.group(b.toks(rng.randint(1, 30)), b.responses(rng.randint(1, 5)))
    for row in rng.sample(b.rows, min(len(b.rows), rng.randint(1, 3))):  # duplicate rows
        b.rows.append(row)
    rng.shuffle(b.rows)
    if all(not r for _, r, _ in b.rows):
        b.rows.append(([1], [2], b.new_gid()))
    prompts, responses, gids = zip(*b.rows)
    return RolloutBatch(list(prompts), list(responses),
                        group_ids=list(gids) if rng.random() < 0.5 else None)


def _weights(batch: RolloutBatch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (len(batch), batch.max_response_len)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def oracle(ref, batch: RolloutBatch, temperature: float, w, w_ent):
    """Every row alone through transformers' eager model: log-probs, entropy, gradients."""
    ref.zero_grad(set_to_none=True)
    lp = torch.zeros(len(batch), batch.max_response_len)
    ent = torch.zeros_like(lp)
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
        if not r.size:
            continue
        ids = torch.from_numpy(np.concatenate([p, r]))[None]
        logits = ref(input_ids=ids).logits[0, p.size - 1:p.size - 1 + r.size].float() / temperature
        logp = logits.log_softmax(-1)
        row_lp = logp.gather(-1, torch.from_numpy(r)[:, None]).squeeze(-1)
        row_ent = -(logp.exp() * logp).sum(-1)
        ((row_lp * w[i, :r.size]).sum() + 0.3 * (row_ent * w_ent[i, :r.size]).sum()).backward()
        lp[i, :r.size], ent[i, :r.size] = row_lp.detach(), row_ent.detach()
    return lp, ent, _grads(ref)


def run_like_engine(model, batch: RolloutBatch, w, w_ent, *, mode: str, rng: random.Random, **kw):
    """Log-probs and gradients of ``batch`` run as the engines do: one call (``"one"``), one call
    under a small row budget (``"rows"``), or ``plan_micro_batches`` over 1-3 ranks, each
    micro-batch its own call, weight-0 repeats included (``"micro"``)."""
    model.zero_grad(set_to_none=True)
    total = batch.num_tokens()
    if mode == "micro":
        world = rng.randint(1, 3)
        keys = batch.group_ids if batch.group_ids is not None else \
            [p.tobytes() for p in batch.prompts]
        world = min(world, len(set(keys)))  # every rank needs a prompt group
        budget = rng.randint(1, max(1, total // 3))
        plan = [step for rank in range(world) for step in
                plan_micro_batches(batch, rank=rank, world=world, max_tokens=budget,
                                   zorro=kw["zorro"])]
        kw["max_tokens_per_row"] = rng.choice([None, rng.randint(1, max(1, total // 4))])
    else:
        plan = [(list(range(len(batch))), True)]
        if mode == "rows":
            kw["max_tokens_per_row"] = rng.choice([1, rng.randint(2, max(2, total // 3))])
    real = sorted(i for rows, ok in plan if ok for i in rows)
    assert real == list(range(len(batch))), "micro-batches must hold every row exactly once"
    lp = torch.zeros(len(batch), batch.max_response_len)
    ent = torch.zeros_like(lp)
    for rows, ok in plan:
        mb = batch.select(rows)
        st = compute_logprobs(model, mb, entropy=True, **kw)
        width = mb.max_response_len
        assert st.logprobs.shape == st.entropy.shape == st.mask.shape == (len(rows), width)
        assert st.logprobs.dtype == st.entropy.dtype == torch.float32
        assert torch.equal(st.mask.cpu(), mb.response_mask())
        assert (st.logprobs[~st.mask] == 0).all() and (st.entropy[~st.mask] == 0).all()
        idx = torch.tensor(rows)
        loss = (st.logprobs * w[idx, :width]).sum() + 0.3 * (st.entropy * w_ent[idx, :width]).sum()
        (loss if ok else loss * 0.0).backward()  # a weight-0 repeat, as the engine runs it
        if ok:
            lp[idx, :width], ent[idx, :width] = st.logprobs.detach(), st.entropy.detach()
    return lp, ent, _grads(model)


def _close_grads(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and want, what
    for name, g in want.items():
        rel = (got[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert rel < 1e-4, f"{what} {name}: relative grad error {rel:.2e}"


@pytest.mark.parametrize("case", range(CASES))
def test_zorro_equals_naive_on_adversarial_batches(case):
    family = FAMILIES[case % len(FAMILIES)]
    model, trained, ref = _models(family)
    rng = random.Random(1000 + case)
    batch = adversarial_batch(case, model.config.vocab_size, _specials(model.config))
    temperature = rng.choice([1.0, 1.0, 0.7, 1.6])
    w, w_ent = _weights(batch, case)
    want_lp, want_ent, want_g = oracle(ref, batch, temperature, w, w_ent)
    mask = batch.response_mask()
    mode = ["one", "rows", "micro"][case % 3]
    common = {"temperature": temperature, "chunk_size": rng.choice([None, 1, 7, 64])}
    runs = {"zorro": {"zorro": True, "zorro_attention": rng.choice(["auto", "flex", "split"])},
            "packed naive": {"zorro": False, "naive_layout": "packed"}}
    if mode != "rows":  # the padded layout takes no row budget
        runs["padded naive"] = {"zorro": False, "naive_layout": "padded"}
    for name, kw in runs.items():
        what = f"case {case}: {family} {name} {mode} {common}"
        lp, ent, grads = run_like_engine(trained if mode == "micro" else model, batch, w, w_ent,
                                         mode=mode, rng=random.Random(case), **kw, **common)
        for got, want in ((lp, want_lp), (ent, want_ent)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0,
                                       msg=lambda m, w=what: f"{w}: {m}")
        assert (lp[mask] < 0).all() and (ent[mask] > 0).all(), what
        _close_grads(grads, want_g, what)


def test_the_fuzz_reaches_every_structure():
    """The generator really produces what the docstring claims, over the seeds the test runs."""
    cfg = model_config(FAMILIES[0])
    seen = set()
    for case in range(CASES):
        b = adversarial_batch(case, cfg.vocab_size, _specials(cfg))
        seqs = [tuple(np.concatenate([p, r]).tolist()) for p, r in zip(b.prompts, b.responses)]
        prompts = [tuple(p.tolist()) for p in b.prompts]
        n = len(b)
        branches = set()  # spans after which two prompts part
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                pi, pj = prompts[i], prompts[j]
                if len(pi) < len(pj) and pj[:len(pi)] == pi:
                    seen.add("prompt prefix of prompt")
                    if b.group_ids is not None and b.group_ids[i] == b.group_ids[j]:
                        seen.add("prompt prefix of prompt, same group")
                if seqs[i] == seqs[j] and pi != pj:
                    seen.add("same sequence, other split")
                if seqs[i] == seqs[j] and pi == pj:
                    seen.add("duplicate row")
                if len(seqs[i]) <= len(pj) and pj[:len(seqs[i])] == seqs[i]:
                    seen.add("sequence inside another prompt")
                if b.group_ids is not None and pi == pj and b.group_ids[i] != b.group_ids[j]:
                    seen.add("one prompt, two group ids")
                ri, rj = b.responses[i].tolist(), b.responses[j].tolist()
                if pi == pj and 0 < len(ri) < len(rj) and rj[:len(ri)] == ri:
                    seen.add("response prefix of response")
                lcp = next((k for k, (x, y) in enumerate(zip(pi, pj)) if x != y), None)
                if lcp is not None:
                    branches.add(pi[:lcp])
                    if lcp in EDGES:
                        seen.add(f"head {lcp}")
        if branches & set(seqs):
            seen.add("a sequence ends where prompts part")
        if any(len(p) == 1 for p in prompts) and any(r.size == 1 for r in b.responses):
            seen.add("1-token")
        if any(r.size == 0 for r in b.responses):
            seen.add("empty response")
        if max(r.size for r in b.responses) >= 150:
            seen.add("uneven")
        groups = b.group_ids if b.group_ids is not None else prompts
        if any(groups[k] != groups[k + 1] and groups[k] in groups[k + 2:] for k in range(n - 2)):
            seen.add("interleaved groups")
    want = {"prompt prefix of prompt", "same sequence, other split", "duplicate row",
            "sequence inside another prompt", "one prompt, two group ids",
            "response prefix of response", "1-token", "empty response", "uneven",
            "interleaved groups", "prompt prefix of prompt, same group",
            "a sequence ends where prompts part"} | {f"head {e}" for e in EDGES}
    assert want <= seen, want - seen
