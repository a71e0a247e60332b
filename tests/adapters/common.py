"""Helpers shared by the TRL adapter tests."""
from polynya.models import load_model, tiny_tokenizer


def save_tiny_qwen3(tmp_path_factory, name: str, seed: int) -> str:
    """A tiny random Qwen3 and the local tokenizer saved as a model directory (what TRL loads)."""
    d = tmp_path_factory.mktemp(name)
    load_model("tiny:qwen3", seed=seed).save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return str(d)
