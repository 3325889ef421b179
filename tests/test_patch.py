"""The module patcher: what it swaps and skips, identity of parameters, undo, wrappers."""

import copy

import pytest
import torch
from torch import nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op.tools.toy_models import GemmaStyleRMSNorm, LlamaStyleRMSNorm, TinyLlama


class Qwen2RMSNorm(LlamaStyleRMSNorm):
    """An older transformers class: no kernel_layer_name mark, recognized by name."""

    kernel_layer_name = None


class LooksLikeLlamaButIsNot(LlamaStyleRMSNorm):
    """Declares Llama style but computes something else: the probe must catch it."""

    def forward(self, x):
        return super().forward(x) * 2


class ModulesToSaveWrapper(nn.Module):
    """The shape of PEFT's wrapper: the original and per-adapter copies as submodules."""

    def __init__(self, module):
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(module)})

    def forward(self, x):
        return self.modules_to_save["default"](x)


def _randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
    return model


def test_swaps_torch_and_llama_style_keeps_parameters(device):
    model = _randomize(TinyLlama(norm=LlamaStyleRMSNorm)).to(device)
    model.norm = _randomize(nn.RMSNorm(64, eps=1e-5)).to(device)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    tokens = torch.randint(0, 256, (2, 8), device=device)
    with T.fallback_policy("reference"):
        want = model(tokens)
    optimizer = torch.optim.Adam(model.parameters())
    report = T.patch_rmsnorm(model)
    assert len(report.swapped) == 5 and not report.skipped, report
    assert {cls for _, cls in report.swapped} == {"LlamaStyleRMSNorm", "RMSNorm"}
    assert all(isinstance(m, T.PatchedRMSNorm) for m in (model.norm, model.blocks[0].attn_norm))
    assert {n: p for n, p in model.named_parameters()} == params  # the very same objects
    assert all(a is b for a, b in zip(model.parameters(), optimizer.param_groups[0]["params"]))
    assert list(model.state_dict()) == keys
    T.reset_dispatch_stats()
    got = model(tokens)
    assert T.dispatch_stats()["kernel"]["rmsnorm.fwd"] == 5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    got.sum().backward()
    optimizer.step()  # the optimizer built before the patch updates the live parameters


def test_skips_gemma_and_lookalikes_with_reasons(device):
    model = nn.Sequential(GemmaStyleRMSNorm(16), LooksLikeLlamaButIsNot(16), Qwen2RMSNorm(16), nn.LayerNorm(16)).to(device)
    report = T.patch_rmsnorm(model)
    assert report.swapped == [("2", "Qwen2RMSNorm")]
    skipped = {name: why for name, _, why in report.skipped}
    assert set(skipped) == {"0", "1"}
    assert "other semantics" in skipped["0"] and "other semantics" in skipped["1"]
    assert isinstance(model[0], GemmaStyleRMSNorm) and isinstance(model[3], nn.LayerNorm)
    assert "skipped 0 (GemmaStyleRMSNorm)" in str(report)


def test_idempotent_and_unpatch_restores_exactly(device):
    model = TinyLlama().to(device)
    originals = {n: m for n, m in model.named_modules()}
    first = T.patch_rmsnorm(model)
    second = T.patch_rmsnorm(model)
    assert len(first.swapped) == 5 and second.swapped == []
    assert {why for *_, why in second.skipped} == {"already patched"}
    assert T.unpatch_rmsnorm(model) == 5
    assert {n: m for n, m in model.named_modules()} == originals
    assert all(type(m) is not T.PatchedRMSNorm for m in model.modules())


def test_context_manager_and_checkpoints(device, tmp_path):
    model = _randomize(TinyLlama()).to(device)
    torch.save(model.state_dict(), tmp_path / "before.pt")
    with T.patched_rmsnorm(model) as report:
        assert len(report.swapped) == 5
        model.load_state_dict(torch.load(tmp_path / "before.pt"))  # a checkpoint saved before loads
        torch.save(model.state_dict(), tmp_path / "during.pt")
    assert not any(isinstance(m, T.PatchedRMSNorm) for m in model.modules())
    model.load_state_dict(torch.load(tmp_path / "during.pt"))  # and one saved while patched loads after


def test_peft_style_wrapper_and_shared_modules(device):
    norm = nn.RMSNorm(16).to(device)
    model = nn.Sequential(ModulesToSaveWrapper(norm), norm)  # the same module under two parents
    report = T.patch_rmsnorm(model)
    # the shared module is swapped once (reported under its first path) plus the adapter's copy
    assert {n for n, _ in report.swapped} == {"1", "0.modules_to_save.default"}
    assert isinstance(model[0].original_module, T.PatchedRMSNorm)
    assert model[1] is model[0].original_module  # shared stays shared
    T.unpatch_rmsnorm(model)
    assert model[1] is norm and model[0].original_module is norm


def test_patched_module_dtype_rules(device):
    """Llama's rule: output dtype is promote(weight, input); nn.RMSNorm's: the input's."""
    llama = LlamaStyleRMSNorm(32).to(device)  # fp32 weight
    torch_norm = nn.RMSNorm(32).to(device)
    model = nn.ModuleList([llama, torch_norm])
    T.patch_rmsnorm(model)
    x = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
    assert model[0](x).dtype == llama(x).dtype == torch.float32
    assert model[1](x).dtype == torch_norm(x).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(4, 8), (8,)])
def test_multi_dim_and_no_weight(device, shape):
    model = nn.Sequential(nn.RMSNorm(shape, elementwise_affine=False)).to(device)
    assert len(T.patch_rmsnorm(model).swapped) == 1
    x = torch.randn(3, *shape, device=device)
    torch.testing.assert_close(model(x), nn.functional.rms_norm(x, shape), atol=1e-5, rtol=1e-4)


def test_meta_parameters_are_skipped():
    with torch.device("meta"):
        model = nn.Sequential(nn.RMSNorm(8))
    report = T.patch_rmsnorm(model)
    assert report.swapped == [] and "meta" in report.skipped[0][2]


def test_root_module_is_reported_not_swapped():
    norm = nn.RMSNorm(8)
    report = T.patch_rmsnorm(norm)
    assert report.swapped == [] and "root module" in report.skipped[0][2]


def test_dynamic_hidden_size_compiles_once(device):
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: T.rms_norm(x, (x.shape[-1],)), backend=counter, fullgraph=True, dynamic=True)
    for n in (8, 16, 24):
        x = torch.randn(3, n, device=device)
        torch.testing.assert_close(f(x), nn.functional.rms_norm(x, (n,)), atol=1e-5, rtol=1e-4)
    assert counter.frame_count == 1


def test_real_transformers_models(device):
    """Real Hugging Face classes built from tiny configs (nothing downloaded): Llama and Qwen2
    norms are swapped and the logits match; Gemma's (1 + weight) norms are reported, untouched."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, head_dim=8)
    tokens = torch.randint(0, 128, (2, 10), device=device)
    for name, swapped in (("Llama", 5), ("Qwen2", 5), ("Gemma", 0)):
        torch.manual_seed(0)
        config = getattr(transformers, f"{name}Config")(**small)
        model = getattr(transformers, f"{name}ForCausalLM")(config).to(device).eval()
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__.endswith("RMSNorm"):
                    m.weight.uniform_(0.5, 1.5)
            want = model(tokens).logits
        report = T.patch_rmsnorm(model)
        assert len(report.swapped) == swapped, report
        if swapped:
            with torch.no_grad():
                got = model(tokens).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:
            assert len(report.skipped) == 5 and all("not recognized" in why for *_, why in report.skipped), report
