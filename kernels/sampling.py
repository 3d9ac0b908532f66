"""Token sampling on device: temperature, top-k, top-p, and exact categorical draws by the exponential race
(argmax p_v / E_v with E_v ~ Exp(1), the official sampler's Gumbel-max form), from a seeded generator so a
request's samples are reproducible. Temperature 0 is argmax (ties to the lowest id)."""

import torch


def distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [R, V] -> the sampling distribution [R, V] (float32, truncated by top-k / top-p, renormalized).

    Bytes moved: logits read once, probabilities written once (a sort of V per row for top-p)."""
    p = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if 0 < top_k < p.shape[-1]:
        kth = p.topk(top_k, dim=-1).values[..., -1:]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
    if top_p < 1.0:
        sp, order = p.sort(dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly above each entry
        sp = torch.where(before < top_p * sp.sum(-1, keepdim=True), sp, torch.zeros_like(sp))
        p = torch.zeros_like(p).scatter(-1, order, sp)
    return p / p.sum(-1, keepdim=True)


def draw(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One categorical draw per row of p [R, V] -> int64 [R]."""
    e = torch.empty_like(p).exponential_(1.0, generator=generator)
    return (p / e).argmax(-1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    return draw(distribution(logits, temperature, top_k, top_p), generator)
