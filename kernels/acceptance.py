"""Sampling and draft acceptance on the device, with every parameter a tensor: nothing reads the host, so a
whole decode cycle (draft, verify, accept) can be captured in one CUDA graph and replayed.

Randomness comes from a counter-based generator: uniform(key, i) = splitmix64(seed, counter, i) in 53
bits. The key tensor [seed, counter] lives on the device; each call consumes a block of counter values and
advances the counter in place, so replays draw fresh numbers and a seed reproduces a request exactly, on
CPU and GPU alike (the arithmetic is integer, identical everywhere).

The sampling distribution is defined here (kernels/sampling.py's reference is this, with numbers for
parameters): temperature 0 is argmax; otherwise p = softmax(logits / T), truncated by top-k (k = 0: off)
and top-p (p = 1: off), renormalized; draws by the exponential race
argmax(p / E), E = -log(1 - U). Speculative acceptance (Leviathan et al.): accept draft i with probability
min(1, p_i(d_i) / r_i(d_i)); at the first rejection draw from normalize(max(0, p_i - r_i)); if all pass,
draw from p_{k+1}. Greedy: the longest prefix equal to the target's argmax, then its argmax.
"""

import torch

_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def uniform(key: torch.Tensor, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) (float64) from key = [seed, counter] (int64, device); advances the counter."""
    i = torch.arange(n, device=key.device, dtype=torch.int64)
    x = _mix(key[0] * _GOLDEN + _mix((key[1] + i) * _GOLDEN))
    key[1] += n
    return _shr(x, 11).double() * 2.0**-53


def distribution(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """logits [R, V]; params = [temperature, top_p, top_k] (float tensor) -> p [R, V] float32."""
    temperature, top_p, top_k = params[0], params[1], params[2]
    p = torch.softmax(logits.float() / temperature.clamp(min=1e-5), dim=-1)
    sp, order = p.sort(dim=-1, descending=True)
    rank = torch.arange(p.shape[-1], device=p.device)
    keep = (top_k <= 0) | (rank < top_k)  # top-k on the sorted order
    kth = sp.gather(-1, (top_k.long().clamp(1, p.shape[-1]) - 1).expand(p.shape[0], 1))
    keep = keep | (sp >= kth)  # ties with the k-th value stay
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    before = sp.cumsum(-1) - sp  # mass strictly above each entry
    keep = (top_p >= 1.0) | (before < top_p * sp.sum(-1, keepdim=True))
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    p = torch.zeros_like(p).scatter(-1, order, sp)
    return p / p.sum(-1, keepdim=True)


def draw(p: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row of p [R, V] -> int64 [R] (exponential race)."""
    e = -torch.log1p(-uniform(key, p.numel()).view(p.shape))
    return (p.double() / e).argmax(-1)


def sample(logits: torch.Tensor, params: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Greedy when params[0] (temperature) is 0, else a draw: both computed, one selected (no branch on a
    device value)."""
    greedy = logits.argmax(-1)
    drawn = draw(distribution(logits, params), key)
    return torch.where(params[0] == 0, greedy, drawn)


def accept(target: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, params: torch.Tensor,
           key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target logits [k+1, V], drafts [k], draft_logits [k, V] -> (j, b): accepted drafts and the next token
    (both int64 scalars on the device)."""
    k = drafts.numel()
    # greedy
    best = target.argmax(-1)
    match = torch.cat((drafts == best[:k], torch.zeros(1, dtype=torch.bool, device=drafts.device)))
    j_greedy = torch.cumprod(match.long(), 0).sum()
    b_greedy = best.gather(0, j_greedy.view(1))[0]
    # sampling: p for every verify row, r for every draft row
    p = distribution(target, params)
    r = distribution(draft_logits, params)
    pd = p[:k].gather(1, drafts.view(-1, 1))[:, 0]
    rd = r.gather(1, drafts.view(-1, 1))[:, 0]
    u = uniform(key, k)
    ok = torch.cat((u * rd < pd, torch.zeros(1, dtype=torch.bool, device=drafts.device)))
    j_sampled = torch.cumprod(ok.long(), 0).sum()
    residual = (p[:k] - r).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p[:k])
    rows = torch.cat((residual, p[k:]), 0)  # row i: where the next token comes from if i is the first miss
    b_sampled = draw(rows, key).gather(0, j_sampled.view(1))[0]
    sampled = params[0] > 0
    return torch.where(sampled, j_sampled, j_greedy), torch.where(sampled, b_sampled, b_greedy)
