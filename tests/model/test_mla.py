"""MLA: max-logit tracker vs brute force, eager == sdpa, the absorbed (inference) form as an oracle, and the
head-major weight layout that QK-Clip relies on."""

import pytest
import torch

import pilotrun.model.mla as mla_module
from pilotrun.model.mla import MLA
from pilotrun.model.rope import build_rope_table


def make_mla(q_lora_rank: int = 0, seed: int = 0, std: float = 0.2) -> MLA:
    torch.manual_seed(seed)
    mla = MLA(d_model=32, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=6)
    with torch.no_grad():
        for name, parameter in mla.named_parameters():
            if not name.endswith("norm.weight"):
                parameter.normal_(0, std)
    return mla


def inputs(seq: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(3, seq, 32, generator=torch.Generator().manual_seed(seed))
    cos, sin = build_rope_table(4, seq, 10000.0)
    return x, cos, sin


def brute_force_max_logits(mla: MLA, x, cos, sin) -> torch.Tensor:
    """Per head: max over batch, i and j <= i of scale * q_i . k_j, computed one pair at a time in float64."""
    with torch.no_grad():
        q, k, _ = mla.project_queries_keys_values(x, cos, sin)
    q, k = q.double(), k.double()
    batch, heads, seq, _ = q.shape
    best = torch.full((heads,), float("-inf"), dtype=torch.float64)
    for i in range(seq):
        for j in range(i + 1):
            logits = (q[:, :, i] * k[:, :, j]).sum(-1) * mla.softmax_scale  # [B, H]
            best = torch.maximum(best, logits.amax(dim=0))
    return best


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_max_logit_tracker_equals_brute_force_for_eager_and_chunked_sdpa(q_lora_rank, monkeypatch):
    mla = make_mla(q_lora_rank)
    x, cos, sin = inputs()
    expected = brute_force_max_logits(mla, x, cos, sin)
    mla.attn_impl = "eager"
    mla(x, cos, sin)
    assert torch.allclose(mla.qk_max_logit.double(), expected, rtol=1e-5, atol=0)
    mla.qk_max_logit.fill_(float("-inf"))
    monkeypatch.setattr(mla_module, "MAX_LOGIT_QUERY_CHUNK", 7)  # several chunks, one partial
    mla.attn_impl = "sdpa"
    mla(x, cos, sin)
    assert torch.allclose(mla.qk_max_logit.double(), expected, rtol=1e-5, atol=0)
    # Negative maxima are kept signed (QK-Clip must see them as they are).
    assert expected.abs().min() > 0


def test_tracker_is_a_running_max_and_idle_in_eval_mode():
    mla = make_mla()
    x, cos, sin = inputs()
    mla.eval()
    with torch.no_grad():
        mla(x, cos, sin)
    assert torch.isinf(mla.qk_max_logit).all()
    mla.train()
    mla(x[:1], cos, sin)
    first = mla.qk_max_logit.clone()
    mla(x[1:], cos, sin)
    mla_all = make_mla()
    mla_all(x, cos, sin)
    assert torch.equal(mla.qk_max_logit, mla_all.qk_max_logit)
    assert (mla.qk_max_logit >= first).all()


def out_of_place_eager_attention(mla: MLA, q, k, v) -> torch.Tensor:
    """Eager attention as written before its mask went in place and was kept between forwards."""
    seq = q.shape[2]
    logits = torch.matmul(q, k.transpose(-1, -2)).float() * mla.softmax_scale
    logits = logits.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1).to(v.dtype), v)


@pytest.mark.parametrize("seq", [20, 7, 20])
def test_eager_attention_masks_in_place_with_the_kept_mask_bit_for_bit(seq):
    # The mask is built once per length and reused; the logits are masked in place. Output and the gradients
    # of q, k and v equal the out-of-place form's bit for bit, and the kept mask is never written.
    mla = make_mla(q_lora_rank=12)
    x, cos, sin = inputs(seq)
    with torch.no_grad():
        q, k, v = mla.project_queries_keys_values(x, cos, sin)
    upstream = torch.randn(3, 4, seq, 6, generator=torch.Generator().manual_seed(5))
    results = []
    for attention in (mla.eager_attention, lambda *a: out_of_place_eager_attention(mla, *a)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        output = attention(*leaves)
        output.backward(upstream)
        results.append([output.detach()] + [leaf.grad for leaf in leaves])
    for ours, reference in zip(*results, strict=True):
        assert torch.equal(ours, reference)
    kept = mla_module.causal_mask(0, seq, q.device)
    assert torch.equal(kept, torch.ones(seq, seq, dtype=torch.bool).triu(1))


def test_eager_attention_in_blocks_of_query_rows_equals_one_block(monkeypatch):
    # 3 blocks of 8 rows (the last one short) against one block of all 20: the same attention to rounding
    # (each block's softmax leaves out only masked keys), the same per-head max logit exactly, and each block
    # multiplies only the keys up to its last row.
    mla = make_mla(q_lora_rank=12)
    x, cos, sin = inputs(20)
    with torch.no_grad():
        q, k, v = mla.project_queries_keys_values(x, cos, sin)
    upstream = torch.randn(3, 4, 20, 6, generator=torch.Generator().manual_seed(5))
    products = []
    matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: products.append(tuple(b.shape)) or matmul(a, b))
    results, maxima = [], []
    for rows in (8, 20):
        monkeypatch.setattr(mla_module, "EAGER_QUERY_CHUNK", rows)
        mla.qk_max_logit.fill_(float("-inf"))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        output = mla.eager_attention(*leaves)
        output.backward(upstream)
        results.append([output.detach()] + [leaf.grad for leaf in leaves])
        maxima.append(mla.qk_max_logit.clone())
    for blocks, one in zip(*results, strict=True):
        assert torch.allclose(blocks, one, rtol=1e-5, atol=1e-6)
    assert torch.equal(maxima[0], maxima[1])
    keys_of_q_k = [shape[-1] for shape in products[:6:2]]  # Q K^T then P V per block: K^T is [.., d_qk, keys]
    assert keys_of_q_k == [8, 16, 20]
    assert [shape[-1] for shape in products[6:8:2]] == [20]


@pytest.mark.parametrize("pad_value", [False, True])
def test_eager_and_sdpa_agree_in_fp32(pad_value):
    mla = make_mla(q_lora_rank=12)
    mla.pad_value_for_flash = pad_value
    x, cos, sin = inputs()
    mla.attn_impl = "eager"
    eager = mla(x, cos, sin)
    mla.attn_impl = "sdpa"
    sdpa = mla(x, cos, sin)
    assert torch.allclose(eager, sdpa, rtol=0, atol=1e-5)
    grad_eager = torch.autograd.grad(eager.square().sum(), mla.wkv_b.weight)[0]
    grad_sdpa = torch.autograd.grad(mla(x, cos, sin).square().sum(), mla.wkv_b.weight)[0]
    assert torch.allclose(grad_eager, grad_sdpa, rtol=1e-4, atol=1e-5)


def test_eager_and_sdpa_agree_under_bf16_autocast():
    mla = make_mla()
    x, cos, sin = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mla.attn_impl = "eager"
        eager = mla(x, cos, sin).float()
        mla.attn_impl = "sdpa"
        sdpa = mla(x, cos, sin).float()
    assert (eager - sdpa).abs().max() < 2e-2 * eager.abs().max()


def absorbed_attention(mla: MLA, x, cos, sin) -> torch.Tensor:
    """Inference-style MLA: fold W^UK into the query and attend over the cached latent c^KV, then apply W^UV.
    Shares no attention code with MLA.forward (only the projections' weights)."""
    from pilotrun.model.rope import apply_rope

    batch, seq, _ = x.shape
    h, d_n, d_r, d_v, r = (
        mla.n_heads,
        mla.qk_nope_head_dim,
        mla.qk_rope_head_dim,
        mla.v_head_dim,
        mla.kv_lora_rank,
    )
    q = mla.wq(x) if mla.q_lora_rank == 0 else mla.wq_b(mla.q_norm(mla.wq_a(x)))
    q = q.view(batch, seq, h, d_n + d_r)
    q_content, q_rotary = q[..., :d_n], apply_rope(q[..., d_n:], cos, sin)
    latent, k_rotary = mla.wkv_a(x).split([r, d_r], dim=-1)
    latent = mla.kv_norm(latent)  # [B, T, r]: the cache
    k_rotary = apply_rope(k_rotary.unsqueeze(2), cos, sin).squeeze(2)  # [B, T, d_r]: the cache
    wkv_b = mla.wkv_b.weight.view(h, d_n + d_v, r)
    q_latent = torch.einsum("bthn,hnr->bthr", q_content, wkv_b[:, :d_n])  # absorb W^UK
    scores = (torch.einsum("bthr,bsr->bhts", q_latent, latent)
              + torch.einsum("bthd,bsd->bhts", q_rotary, k_rotary)) * mla.softmax_scale
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    attended_latent = torch.einsum("bhts,bsr->bthr", scores.softmax(-1), latent)
    output = torch.einsum("bthr,hvr->bthv", attended_latent, wkv_b[:, d_n:])  # apply W^UV
    return mla.wo(output.reshape(batch, seq, h * d_v))


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_training_path_equals_the_absorbed_inference_form(q_lora_rank):
    mla = make_mla(q_lora_rank).eval()
    x, cos, sin = inputs()
    with torch.no_grad():
        assert torch.allclose(mla(x, cos, sin), absorbed_attention(mla, x, cos, sin), rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_head_major_rows_scale_exactly_one_heads_logits(q_lora_rank):
    """The layout QK-Clip relies on: scaling head h's q^C rows and k^C rows by sqrt(g) and its q^R rows by g
    multiplies that head's logits by g and leaves every other head, and every value, unchanged."""
    mla = make_mla(q_lora_rank)
    x, cos, sin = inputs()
    before = brute_force_max_logits(mla, x, cos, sin)
    with torch.no_grad():
        _, _, v_before = mla.project_queries_keys_values(x, cos, sin)
    gamma, head = 0.3, 2
    d_n, d_r, d_v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    with torch.no_grad():
        query = (mla.wq if q_lora_rank == 0 else mla.wq_b).weight.view(mla.n_heads, d_n + d_r, -1)
        query[head, :d_n] *= gamma**0.5
        query[head, d_n:] *= gamma
        mla.wkv_b.weight.view(mla.n_heads, d_n + d_v, -1)[head, :d_n] *= gamma**0.5
        _, _, v_after = mla.project_queries_keys_values(x, cos, sin)
    after = brute_force_max_logits(mla, x, cos, sin)
    others = [h for h in range(mla.n_heads) if h != head]
    assert torch.allclose(after[others], before[others], rtol=1e-12, atol=0)
    assert torch.allclose(after[head], before[head] * gamma, rtol=1e-5, atol=0)
    assert torch.equal(v_after, v_before)
