"""The patcher on a real PEFT LoRA model: a tiny transformers Llama with LoRA adapters and its
norms trained as ``modules_to_save`` copies, patched and compiled, takes the same training
step as the unpatched model in eager mode."""

import copy

import pytest
import torch
from checks import tiny_llama
from tolerances import MODEL, few_roundings

import torch_rmsnorm_op as T

transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
peft = pytest.importorskip("peft", reason="peft is not installed here (pip install peft, or the test extra)")

# fp32 on CPU; the kernels reduce in another order than the modules. AdamW's first step moves
# each element by about lr * sign(grad), so an element whose gradient is near zero could move
# either way: the step is SGD's, whose update is lr * grad and keeps differences small.
LOSS_TOL = few_roundings(torch.float32)
GRAD_TOL = MODEL[torch.float32]
LR = 0.5


def _lora_llama():
    model = tiny_llama((0.5, 1.5))
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           modules_to_save=["norm"], init_lora_weights=False)
    return peft.get_peft_model(model, lora)


def _step(loss_fn, model, tokens):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loss = loss_fn(tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_llama_patched_compiled_training_step(device):
    model = _lora_llama().to(device).train()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    want = _step(lambda t: reference(input_ids=t, labels=t).loss, reference, tokens)

    report = T.patch_rmsnorm(model)
    # modules_to_save=["norm"] wraps every module whose name ends so in a ModulesToSaveWrapper:
    # the original and the adapter's trainable copy, both swapped
    norms = ("layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm")
    assert {name for name, *_ in report.swapped} == {f"base_model.model.model.{norm}.{copy}" for norm in norms
                                                     for copy in ("original_module", "modules_to_save.default")}
    assert report.semantics_counts() == {"llama": 6} and not report.skipped, report
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: model(input_ids=t, labels=t).loss, fullgraph=True, backend="aot_eager")
    T.reset_dispatch_stats()
    loss, grads, params = _step(compiled, model, tokens)
    stats = T.dispatch_stats()
    if device.type == "cuda":  # the graph launches the kernels: three call sites each way, decided while tracing
        assert stats["compiled"] == {"rmsnorm.fwd: kernel": 3, "rmsnorm.bwd: kernel": 3}, stats
    else:  # three norms run per forward, each one opaque call
        assert stats["kernel"].get("rmsnorm.fwd", 0) == 3, stats

    torch.testing.assert_close(loss, want[0], **LOSS_TOL)
    assert grads.keys() == want[1].keys() and any("modules_to_save" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], want[1][name], **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(params[name], want[2][name], **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")
