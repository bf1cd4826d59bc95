"""The delta rule with its gradients for training (src/delta_train.c): the function and the
gradients torch's autograd gives, the same bytes at any thread count, and transformers' layers
running it only where it serves and only inside the block."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

from flashrt_ros.runtime.backends.cpu import delta_train
from flashrt_ros.sim.train_policy import actions, build, policy_config
from thread_counts import at_thread_counts


def _draws(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _recurrence(q, k, v, g, beta):
    """The definition, step by step, in torch (autograd takes its gradients): [n, t, d] rows."""
    n, t, dk = q.shape
    outs = []
    for h in range(n):
        state, steps = torch.zeros(dk, v.shape[-1], dtype=q.dtype), []
        for i in range(t):
            a = g[h, i].exp()
            r = v[h, i] - (a * state).t() @ k[h, i]
            state = a * state + torch.outer(k[h, i], beta[h, i] * r)
            steps.append(state.t() @ q[h, i])
        outs.append(torch.stack(steps) if steps else torch.zeros(0, v.shape[-1], dtype=q.dtype))
    return torch.stack(outs)


def test_the_build_installs_the_kernel():
    """colcon builds it (CMakeLists.txt); without it training quietly takes transformers' rule."""
    assert delta_train.available()


@pytest.mark.parametrize("n, t, dk, dv", [(1, 1, 1, 1), (3, 5, 4, 3), (2, 17, 32, 32), (4, 9, 7, 33),
                                          (1, 2, delta_train.MAX_DIM, delta_train.MAX_DIM)])
def test_the_kernel_gives_the_rule_and_its_gradients(n, t, dk, dv):
    q, k, v, a, b = _draws((n, t, dk), (n, t, dk), (n, t, dv), (n, t), (n, t), seed=n * t)
    k = k / k.norm(dim=-1, keepdim=True)
    g, beta = -torch.nn.functional.softplus(a), b.sigmoid()
    weight = _draws((n, t, dv), seed=99)[0]
    xs = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
    (_recurrence(*xs) * weight.double()).sum().backward()
    ys = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    out, final = delta_train._Rule.apply(*ys)
    (out * weight).sum().backward()
    assert torch.allclose(out.double(), _recurrence(*[x.detach() for x in xs]), atol=1e-5, rtol=1e-4)
    for name, x, y in zip(("q", "k", "v", "g", "beta"), xs, ys):
        assert torch.allclose(y.grad.double(), x.grad, atol=1e-4, rtol=1e-4), name
    assert final.shape == (n, dk, dv) and not final.requires_grad


def test_an_empty_sequence_is_no_steps():
    q, k, v, g, beta = (torch.zeros(shape) for shape in ((2, 0, 4), (2, 0, 4), (2, 0, 3), (2, 0), (2, 0)))
    out, final = delta_train._Rule.apply(q, k, v, g, beta)
    assert out.shape == (2, 0, 3) and torch.equal(final, torch.zeros(2, 4, 3))


def _transformers_call(rule, seed: int = 3):
    """transformers' arguments (two key heads serving four value heads), through ``rule``: the
    output, the final state and every input's gradient."""
    q, k, v, a, b = _draws((3, 21, 2, 16), (3, 21, 2, 16), (3, 21, 4, 8), (3, 21, 4), (3, 21, 4), seed=seed)
    xs = [x.requires_grad_() for x in (q, k, v, a, b)]
    out, final = rule(xs[0], xs[1], xs[2], g=-torch.nn.functional.softplus(xs[3]), beta=xs[4].sigmoid(),
                      initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (out * _draws(out.shape, seed=7)[0]).sum().backward()
    return out.detach(), final.detach(), [x.grad for x in xs]


def test_it_computes_what_transformers_chunked_rule_does():
    out, final, grads = _transformers_call(delta_train.rule)
    ref_out, ref_final, ref_grads = _transformers_call(modeling.torch_chunk_gated_delta_rule)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(final, ref_final, atol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        assert torch.allclose(grad, ref, atol=1e-5)


@pytest.mark.parametrize("flush", [False, True])
def test_the_bytes_do_not_depend_on_the_thread_count(flush):
    """One thread runs each sequence-head from start to end, in the caller's floating-point mode:
    the split changes no sum, and with flush-to-zero on (as an engine leaves its thread) decays
    small enough to be denormal are flushed on every worker alike."""
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("torch cannot set flush-to-zero on this CPU")
    torch.set_flush_denormal(False)

    def run():
        torch.set_flush_denormal(flush)
        try:
            q, k, v, g, beta = _draws((6, 9, 8), (6, 9, 8), (6, 9, 4), (6, 9), (6, 9), seed=11)
            g = torch.full_like(g, -90.0)   # exp(-90): a denormal decay
            xs = [x.requires_grad_() for x in (q, k, v, g, beta.sigmoid().detach())]
            out, final = delta_train._Rule.apply(*xs)
            out.sum().backward()
            return [out.detach(), final, *(x.grad for x in xs)]
        finally:
            torch.set_flush_denormal(False)

    first, *others = at_thread_counts(run)
    for other in others:
        assert all(torch.equal(x, y) for x, y in zip(first, other))

    def rule_call():
        out, final, grads = _transformers_call(delta_train.rule, seed=5)
        return [out, final, *grads]

    first, *others = at_thread_counts(rule_call)
    for other in others:
        assert all(torch.equal(x, y) for x, y in zip(first, other))


@pytest.mark.parametrize("case", ["float64", "a bfloat16 key", "initial state", "wide heads", "packed"])
def test_a_call_it_does_not_serve_is_refused_and_inside_the_block_goes_to_transformers(case, monkeypatch):
    q, k, v = _draws((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8))
    g, beta, extra = -torch.rand(1, 4, 2), torch.rand(1, 4, 2), {"initial_state": None}
    if case == "float64":
        q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    elif case == "a bfloat16 key":
        k = k.bfloat16()
    elif case == "initial state":
        extra["initial_state"] = torch.zeros(1, 2, 8, 8)
    elif case == "wide heads":
        q, k = _draws((1, 4, 2, delta_train.MAX_DIM + 1), (1, 4, 2, delta_train.MAX_DIM + 1))
    else:   # two sequences in one row: one recurrence over both would mix them
        extra["cu_seqlens"] = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="takes float32 CPU tensors"):
        delta_train.rule(q, k, v, g, beta, **extra)
    seen = []
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", lambda *a, **kw: seen.append(kw))
    with delta_train.replacing_transformers():
        modeling.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **extra)
    assert len(seen) == 1


def test_tensors_that_do_not_fit_together_never_reach_the_kernel():
    q, k, v, g, beta = _draws((2, 5, 4), (2, 5, 4), (2, 3, 4), (2, 5), (2, 5))
    with pytest.raises(ValueError, match="v must be a contiguous float32 CPU tensor of shape"):
        delta_train._Rule.apply(q, k, v, g, beta)
    with pytest.raises(ValueError, match="k must be"):
        delta_train._Rule.apply(q, k.bfloat16(), v, g, beta)


def test_its_gradients_are_not_differentiated_again_in_silence():
    xs = [x.requires_grad_() for x in _draws((1, 3, 4), (1, 3, 4), (1, 3, 4), (1, 3), (1, 3))]
    out, _ = delta_train._Rule.apply(*xs)
    (grad,) = torch.autograd.grad(out.sum(), xs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


def test_a_policy_trains_the_same_inside_the_block_and_transformers_is_itself_after_it(monkeypatch):
    """A step of the policy's model, its loss and gradients, with the kernel and without; the
    module's own function is back after the block, an error inside it included."""
    observations, target = _draws((2, 19, policy_config().obs_dim), (2, 19, policy_config().action_dim))
    original = modeling.torch_chunk_gated_delta_rule

    def step() -> list[torch.Tensor]:
        model = build(policy_config(), seed=0)
        torch.nn.functional.mse_loss(actions(model, observations, 16), target).backward()
        return [p.grad for p in model.parameters()]

    calls = []
    counted = delta_train.rule
    monkeypatch.setattr(delta_train, "rule", lambda *a, **kw: calls.append(1) or counted(*a, **kw))
    with delta_train.replacing_transformers() as used:
        assert used and modeling.torch_chunk_gated_delta_rule is not original
        ours = step()
    assert len(calls) == policy_config().layer_types.count("linear_attention")   # each layer's, by the kernel
    assert modeling.torch_chunk_gated_delta_rule is original
    theirs = step()
    assert [g is None for g in ours] == [g is None for g in theirs]   # the embedding and lm head: unused
    assert sum(g is not None for g in ours) > 10
    for mine, ref in zip(ours, theirs):
        assert mine is None or torch.allclose(mine, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(KeyError), delta_train.replacing_transformers():
        raise KeyError("inside")
    assert modeling.torch_chunk_gated_delta_rule is original
