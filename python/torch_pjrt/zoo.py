"""Real models on tpu against the CPU: Hugging Face, timm and torchvision zoos.

    python -m torch_pjrt.zoo                      # every model, Strict, float32
    python -m torch_pjrt.zoo --sample ci --mode defer_and_fuse
    python -m torch_pjrt.zoo --suite timm --dtype bfloat16 --json zoo.json
    python -m torch_pjrt.zoo --sample train --task train --mode compile   # the training tier

Models are built offline from their configs with random weights (no download). Each runs on
the CPU (twice: a model whose two CPU runs differ is "nondeterministic") and on tpu from the
same weights and inputs; outputs are compared per element (float32: 1e-4, bfloat16: 5e-2, the
absolute part scaled to the output's magnitude; see `compare`), and a float32 mismatch is
refereed by a float64 run. A result is one of: pass, mismatch (with the largest difference),
error (with its message), cpu_error (the model fails on the CPU too; not counted),
nondeterministic, crash/timeout (the worker process died or hung). CPU fallbacks are counted
per model.

Models run in worker processes (``--chunk`` models each, so compiled programs do not pile up
in one process); a worker that crashes or hangs costs only its current model. Needs the
``zoo`` extra: transformers, timm, torchvision.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback

MODES = {
    "strict": {"TORCH_TPU_LAUNCH_BLOCKING": "0", "TORCH_TPU_DEFER_AND_FUSE": "0"},
    "debug": {"TORCH_TPU_LAUNCH_BLOCKING": "1", "TORCH_TPU_DEFER_AND_FUSE": "0"},
    "defer_and_fuse": {"TORCH_TPU_LAUNCH_BLOCKING": "0", "TORCH_TPU_DEFER_AND_FUSE": "1"},
    # torch.compile(backend="tpu") of the model, on Strict.
    "compile": {"TORCH_TPU_LAUNCH_BLOCKING": "0", "TORCH_TPU_DEFER_AND_FUSE": "0"},
}
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}

# The fixed sample CI runs: small models from each zoo and family kind (decoders, encoders,
# encoder-decoders, mixture of experts, speech, vision; convnets, transformers, detection,
# segmentation, video).
CI_SAMPLE = [
    *(f"hf:{t}" for t in (
        "albert", "bart", "bert", "bloom", "clip", "convbert", "convnext", "deberta",
        "distilbert", "electra", "falcon", "gemma", "gpt2", "gpt_neox", "gptj", "llama",
        "mistral", "mixtral", "mpt", "opt", "phi", "qwen2", "qwen2_moe", "roberta", "t5",
        "vit", "wav2vec2", "whisper", "xlm-roberta", "swin", "olmoe", "mamba", "fnet",
    )),
    "hf-causal:llama", "hf-causal:gpt2", "hf-causal:qwen3_moe", "hf-s2s:bart", "hf-s2s:t5",
    *(f"timm:{m}" for m in (
        "test_vit", "test_efficientnet", "test_byobnet", "test_convnext", "resnet10t",
        "mobilenetv3_small_050", "efficientnet_b0", "regnetx_002", "convnext_atto",
        "deit_tiny_patch16_224", "ghostnet_050", "lcnet_050", "mixer_s32_224",
    )),
    *(f"tv:{m}" for m in (
        "resnet18", "mobilenet_v3_small", "squeezenet1_1", "shufflenet_v2_x0_5",
        "efficientnet_b0", "mnasnet0_5", "regnet_x_400mf", "alexnet", "googlenet",
        "densenet121", "vit_b_32", "swin_t", "lraspp_mobilenet_v3_large", "r3d_18",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
    )),
]


# The training tier (`--sample train`): 53 Hugging Face architectures (the CI sample's, more
# mixture-of-experts, seq2seq, audio and vision ones) and the CI sample's timm/torchvision
# classifiers, segmenters and video model (detection models need targets to train).
TRAIN_TIER = [
    *(n for n in CI_SAMPLE if n.startswith("hf")),
    *(f"hf-causal:{t}" for t in ("mixtral", "olmoe", "deepseek_v4", "gpt_oss", "phi3",
                                 "gemma2", "qwen3_next")),
    *(f"hf-s2s:{t}" for t in ("marian", "pegasus", "mbart")),
    *(f"hf:{t}" for t in ("hubert", "wavlm", "segformer", "mobilevit", "deit")),
    *(n for n in CI_SAMPLE if not n.startswith("hf") and "rcnn" not in n),
]

# ------------------------------------------------------------------------------------------
# Building models

_LAYERS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
           "decoder_layers", "num_encoder_layers", "num_decoder_layers", "num_blocks"}
_HIDDEN = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim",
           "word_embed_proj_dim", "embedding_size", "projection_dim", "n_embed"}
_HEADS = {"num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads", "num_heads"}
_KV_HEADS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"}
_FFN = {"intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
        "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size",
        "decoder_intermediate_size", "ffn_hidden_size"}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"}
# Multi-head latent attention (DeepSeek-style) dims.
_MLA = [({"qk_rope_head_dim"}, 8), ({"qk_nope_head_dim"}, 8), ({"v_head_dim"}, 16),
        ({"kv_lora_rank", "q_lora_rank"}, 32)]
_SMALL = [(_LAYERS, 2), (_HIDDEN, 64), (_HEADS, 4), (_KV_HEADS, 2), (_FFN, 128),
          ({"head_dim", "d_kv", "attention_head_size"}, 16), ({"rotary_dim"}, 8), (_EXPERTS, 4),
          (_TOP_K, 2), *_MLA]
# The second try for a model whose small config the CPU cannot run: its own widths, only
# fewer layers and experts (when that stays under MAX_PARAMS parameters).
_FEWER = [(_LAYERS, 2), (_EXPERTS, 4), (_TOP_K, 2)]
MAX_PARAMS = 150e6
# timm families whose every model is larger are left out (torchvision: past MAX_PARAMS).
MAX_VISION = 60e6


def _shrink(d, rules=_SMALL):
    """Small sizes for a config's dict (and its sub-configs'): 2 layers, width 64, 4 heads."""
    old_layers = [v for k, v in d.items() if k in _LAYERS and isinstance(v, int)]
    staged = "depths" in d  # hierarchical models: stage count and names follow `depths`
    for names, small in rules:
        for k in names & d.keys():
            if staged and names is _LAYERS:
                continue
            if isinstance(d[k], int) and not isinstance(d[k], bool) and d[k] > small:
                d[k] = small
    new_layers = min([v for k, v in d.items() if k in _LAYERS and isinstance(v, int)] or [0])
    for k, v in list(d.items()):
        if isinstance(v, dict):
            _shrink(v, rules)
        elif isinstance(v, list) and not staged and len(v) in old_layers and len(v) > 2:
            d[k] = v[:new_layers or 2]  # per-layer lists (layer_types, ...)
    return d


def _hf_model(kind, model_type, variant=0):
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto as auto

    mapping = {"hf": auto.MODEL_MAPPING_NAMES, "hf-causal": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
               "hf-s2s": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
               "hf-speech": auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES}[kind]
    import transformers

    cls = getattr(transformers, mapping[model_type])
    d = _shrink(AutoConfig.for_model(model_type).to_dict(), (_SMALL, _FEWER)[variant])
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    cfg = AutoConfig.for_model(model_type, **d)
    cfg._attn_implementation = "eager"
    if variant:
        import torch

        with torch.device("meta"):
            size = sum(p.numel() for p in cls._from_config(cfg).parameters())
        if size > MAX_PARAMS:
            raise ValueError(f"zoo: {size / 1e6:.0f}M parameters with its own widths")
    model = cls._from_config(cfg)
    return model, _hf_inputs(model, cfg)


def _pixels(vis, g):
    """Two random images of a vision config's size and channels."""
    import torch

    # 64 pixels where the config names no size: at 32 a ResNet's last stage is 1x1, and its
    # BatchNorm in training normalizes two values per channel (ill-conditioned: the CPU
    # itself is 1e7 tolerances from float64 there).
    size = getattr(vis, "image_size", 64)
    size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    return torch.randn(2, getattr(vis, "num_channels", 3), *size[-2:], generator=g)


def _hf_inputs(model, cfg):
    import torch

    params = inspect.signature(model.forward).parameters
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None) or 100
    g = torch.Generator().manual_seed(0)
    kw = {}
    name = model.main_input_name
    if name == "input_ids":
        kw["input_ids"] = torch.randint(3, max(4, min(vocab, 1000)), (2, 12), generator=g)
        if "attention_mask" in params:
            kw["attention_mask"] = torch.ones(2, 12, dtype=torch.long)
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            kw["decoder_input_ids"] = torch.randint(3, max(4, min(vocab, 1000)), (2, 7), generator=g)
    elif name == "pixel_values":
        kw["pixel_values"] = _pixels(getattr(cfg, "vision_config", None) or cfg, g)
    elif name == "input_values":
        kw["input_values"] = torch.randn(2, 4000, generator=g)
    elif name == "input_features":
        bins = getattr(cfg, "num_mel_bins", None) or getattr(cfg, "feature_size", 80)
        frames = 2 * getattr(cfg, "max_source_positions", 50)
        kw["input_features"] = torch.randn(2, bins, frames, generator=g)
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            kw["decoder_input_ids"] = torch.randint(3, max(4, min(vocab, 1000)), (2, 5), generator=g)
    else:
        raise NotImplementedError(f"zoo: no inputs for main input {name!r}")
    # Two-tower models (CLIP-like) take both text and images.
    if "pixel_values" in params and "pixel_values" not in kw and hasattr(cfg, "vision_config"):
        kw["pixel_values"] = _pixels(cfg.vision_config, g)
    if "use_cache" in params:
        kw["use_cache"] = False
    return kw


def _timm_model(name):
    import timm
    import torch

    model = timm.create_model(name, pretrained=False)
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    return model, {"x": torch.randn(1, *size, generator=torch.Generator().manual_seed(0))}


def _tv_model(name):
    import torch
    import torchvision.models as tvm

    try:  # detection/segmentation models would download their backbone's weights
        model = tvm.get_model(name, weights=None, weights_backbone=None)
    except TypeError:
        model = tvm.get_model(name, weights=None)
    g = torch.Generator().manual_seed(0)
    module = type(model).__module__
    crop = 224
    with contextlib.suppress(Exception):
        crop = tvm.get_model_weights(name).DEFAULT.transforms().crop_size[0]
    first = next(iter(inspect.signature(model.forward).parameters))
    if ".detection." in module:
        return model, {first: [torch.rand(3, 160, 200, generator=g)]}
    if ".video." in module:
        # MViT and S3D want their own clip length and size; the others take 8 x 112 x 112.
        frames = {"mvit_v1_b": 16, "mvit_v2_s": 16, "s3d": 16}.get(name, 8)
        size = crop if name in ("mvit_v1_b", "mvit_v2_s", "s3d") else 112
        return model, {first: torch.randn(1, 3, frames, size, size, generator=g)}
    if ".optical_flow." in module:
        return model, {"image1": torch.rand(1, 3, 128, 128, generator=g),
                       "image2": torch.rand(1, 3, 128, 128, generator=g), "num_flow_updates": 2}
    return model, {first: torch.randn(1, 3, crop, crop, generator=g)}


def variants(name):
    """How many configurations `build` can try for a model (Hugging Face: small widths, then
    the config's own widths with fewer layers)."""
    return 2 if name.startswith("hf") else 1


def build(name, variant=0):
    """The model (eval mode, CPU) and its keyword inputs for a zoo name."""
    kind, _, model = name.partition(":")
    if kind.startswith("hf"):
        m, kw = _hf_model(kind, model, variant)
    elif kind == "timm":
        m, kw = _timm_model(model)
    elif kind == "tv":
        m, kw = _tv_model(model)
    else:
        raise ValueError(f"zoo: unknown model kind in {name!r} (hf, hf-causal, hf-s2s, hf-speech, timm, tv)")
    _perturb_constant_parameters(m)
    return m.eval(), kw


def _perturb_constant_parameters(model):
    """Adds small noise to parameters initialized to one value (zeroed routers, norms of
    ones): with a router of zeros every expert scores the same, and which experts top-k
    picks among equal scores is each kernel's own choice (the CPU's and CUDA's differ too)."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)


def all_models(suites=("hf", "timm", "tv")):
    names = []
    if "hf" in suites:
        from transformers.models.auto import modeling_auto as auto

        names += [f"hf:{t}" for t in sorted(auto.MODEL_MAPPING_NAMES)]
        names += [f"hf-causal:{t}" for t in sorted(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
        names += [f"hf-s2s:{t}" for t in sorted(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)]
        names += [f"hf-speech:{t}" for t in sorted(auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)]
    if "timm" in suites:
        names += [f"timm:{m}" for m in _timm_per_family()]
    if "tv" in suites:
        import torch
        import torchvision.models as tvm

        def small(name):
            try:
                with torch.device("meta"):
                    model = tvm.get_model(name, weights=None)
            except Exception:  # noqa: BLE001 - the zoo run reports it
                return True
            return sum(p.numel() for p in model.parameters()) <= MAX_PARAMS

        quantized = set(tvm.list_models(module=tvm.quantization))
        names += [f"tv:{m}" for m in sorted(tvm.list_models())
                  if m not in quantized and small(m)]
    return names


def _timm_per_family():
    """One small model per timm module (family): its test model, else its smallest-named."""
    import timm

    order = ("test_", "atto", "femto", "pico", "nano", "tiny", "small", "xs", "mobile", "050",
             "_s", "b0", "18")
    import torch

    def small(name):
        try:
            with torch.device("meta"):
                return sum(p.numel() for p in timm.create_model(name).parameters()) <= MAX_VISION
        except Exception:  # noqa: BLE001 - the zoo run reports it
            return True

    picks = []
    for module in sorted(timm.list_modules()):
        models = sorted(timm.list_models(module=module))
        ranked = [m for key in order for m in models if key in m] + models
        best = next((m for m in dict.fromkeys(ranked) if small(m)), None)
        if best:
            picks.append(best)
    return picks


# ------------------------------------------------------------------------------------------
# Running one model

def _tensors(out):
    """The floating/integer tensors of a model output, in a fixed order."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = [out[k] for k in sorted(out)]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _to(obj, device, dtype=None):
    import torch

    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point():
            obj = obj.to(dtype)
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device, dtype) for k, v in obj.items()}
    return obj


def compare(got, want, tol):
    """Compares outputs: {"ok", "elementwise", "max_abs", "max_rel", "why"}.

    `elementwise`: every element within tol + tol * |cpu| (torch.allclose's rule).
    `ok`: the same with the absolute part scaled to the output's magnitude,
    tol * max(1, max |cpu|): a network whose activations reach 1e7 carries float32 rounding
    of that size into its small outputs too. `max_rel` is the largest difference over the
    output's largest magnitude, reported for every model.
    """
    import torch

    res = {"ok": True, "elementwise": True, "max_abs": 0.0, "max_rel": 0.0, "why": None}

    def fail(why):
        res.update(ok=False, elementwise=False, why=why)
        return res

    if len(got) != len(want):
        return fail(f"{len(got)} outputs, the CPU has {len(want)}")
    for g, w in zip(got, want, strict=True):
        g = g.cpu()
        if g.shape != w.shape or g.dtype != w.dtype:
            return fail(f"output {tuple(g.shape)} {g.dtype}, the CPU's {tuple(w.shape)} {w.dtype}")
        if w.numel() == 0:
            continue
        gf, wf = g.double(), w.double()
        if not bool((torch.isnan(gf) == torch.isnan(wf)).all()):
            return fail("NaN where the CPU has a number")
        if not bool((torch.isinf(gf) == torch.isinf(wf)).all()):
            return fail("infinity where the CPU has a finite number")
        gf, wf = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (gf, wf))
        diff = (gf - wf).abs()
        scale = float(wf.abs().max())
        res["max_abs"] = max(res["max_abs"], float(diff.max()))
        res["max_rel"] = max(res["max_rel"], float(diff.max()) / (scale or 1.0))
        bound = tol * wf.abs()
        res["elementwise"] &= bool((diff <= tol + bound).all())
        res["ok"] &= bool((diff <= tol * max(1.0, scale) + bound).all())
    return res


REFEREE_FACTOR = 4


def _distance(outputs, ref, tol):
    """The largest distance of `outputs` to the float64 `ref`, in units of tol + tol * |ref|
    (NaN where the reference has a number: infinitely far)."""
    import torch

    worst = 0.0
    for x, r in zip(outputs, ref, strict=True):
        if r.is_floating_point() and r.numel():
            d = (x.cpu().double() - r.double()).abs() / (tol + tol * r.double().abs())
            worst = max(worst, float(torch.nan_to_num(d, nan=float("inf")).max()))
    return worst


def _forward(model, kw, compiled):
    import torch

    fn = torch.compile(model, backend="tpu") if compiled else model
    with torch.no_grad():
        return [t.detach().cpu() for t in _tensors(fn(**kw))]


def _loss(outputs):
    """A loss every output feeds: the mean square of each floating output."""
    return sum(t.float().pow(2).mean() for t in outputs if t.is_floating_point())


def _train(model, kw, compiled, steps=3):
    """Losses of `steps` AdamW steps, then the gradients of the last step."""
    import torch

    model.train()
    cfg = getattr(model, "config", None)
    for attr in ("mask_time_prob", "mask_feature_prob", "layerdrop", "encoder_layerdrop",
                 "decoder_layerdrop"):  # training-time randomness of audio and seq2seq models
        if cfg is not None and getattr(cfg, attr, None):
            setattr(cfg, attr, 0.0)
    # Dropout and stochastic depth off: the two devices draw other random numbers. Modules
    # (nn.Dropout, timm's DropPath, torchvision's StochasticDepth) and the float rates that
    # models pass to F.dropout themselves (Hugging Face's `self.dropout = config.dropout`).
    for m in model.modules():
        name = type(m).__name__
        if isinstance(m, torch.nn.Dropout) or "Drop" in name or "StochasticDepth" in name:
            if isinstance(getattr(m, "p", None), float):
                m.p = 0.0
        for k, v in list(vars(m).items()):
            if isinstance(v, float) and ("dropout" in k or k in ("drop_rate", "drop_prob",
                                                                "drop_path_rate", "layerdrop")):
                setattr(m, k, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn = torch.compile(model, backend="tpu") if compiled else model
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(_tensors(fn(**kw)))
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu().reshape(1))
    grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
    return [torch.cat(losses)] + grads


def _generate(model, kw, compiled, sample=False, static=False):
    """Tokens of `model.generate` (8 new ones) from a 6-token prompt (speech models: the
    first clip's features), greedy or sampled."""
    import torch

    main = model.main_input_name
    inputs = {"input_ids": kw["input_ids"][:1, :6]} if main == "input_ids" else {main: kw[main][:1]}
    gen = {"max_new_tokens": 8, "do_sample": sample, "pad_token_id": 0}
    cfg = model.config
    start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if getattr(cfg, "is_encoder_decoder", False) and start is None:
        gen["decoder_start_token_id"] = getattr(cfg, "bos_token_id", None) or 0
    if sample:
        torch.manual_seed(0)
        gen.update(top_k=5)
    if static:
        gen["cache_implementation"] = "static"
    if compiled:
        model.forward = torch.compile(model.forward, backend="tpu")
    with torch.no_grad():
        return [model.generate(**inputs, **gen).cpu()]


TASKS = {
    "forward": _forward,
    "train": _train,
    "generate": _generate,
    "generate-static": lambda m, kw, c: _generate(m, kw, c, static=True),
    "generate-sampled": lambda m, kw, c: _generate(m, kw, c, sample=True),
}


def run_one(name, mode, dtype_name, task="forward", phase=lambda p: None):
    """One model's record. `phase("tpu")` is called when the CPU runs are done."""
    import torch

    import torch_pjrt

    dtype = getattr(torch, dtype_name)
    rec = {"model": name, "mode": mode, "dtype": dtype_name, "task": task}
    t0 = time.time()
    sink = io.StringIO()
    work = TASKS[task]
    first_error = None
    for variant in range(variants(name)):
        try:
            with contextlib.redirect_stdout(sink):
                torch.manual_seed(0)
                model, kw = build(name, variant)
                model = model.to(dtype)
                kw = _to(kw, "cpu", dtype)
                start = copy.deepcopy(model)
                want = work(model, kw, False)
                again = work(copy.deepcopy(start), kw, False)
            rec["variant"] = variant
            break
        except Exception as e:  # noqa: BLE001 - a model that fails on the CPU is not counted
            first_error = first_error or _message(e)
    else:
        rec.update(status="cpu_error", error=first_error, seconds=time.time() - t0)
        return rec
    if len(again) != len(want) or any(
            a.shape != w.shape or not torch.equal(a, w) and not torch.allclose(a, w, equal_nan=True)
            for a, w in zip(again, want, strict=True)):
        rec.update(status="nondeterministic", seconds=time.time() - t0)
        return rec
    phase("tpu")
    # A float64 twin referees mismatches (below); `start` itself moves to tpu.
    twin = copy.deepcopy(start) if dtype == torch.float32 and task in ("forward", "train") else None
    try:
        with contextlib.redirect_stdout(sink):
            tpu_model = start.to("tpu")
            tpu_kw = _to(kw, "tpu")
            torch_pjrt.reset_metrics()
            got = work(tpu_model, tpu_kw, mode == "compile")
    except Exception as e:  # noqa: BLE001 - reported per model
        rec.update(status="error", error=_message(e), seconds=time.time() - t0,
                   fallbacks=_fallbacks(torch_pjrt))
        return rec
    if task == "generate-sampled":
        # tpu draws its own random numbers: the run must work, the tokens may differ.
        same = [g.shape for g in got] == [w.shape for w in want]
        res = {"ok": same, "elementwise": same, "max_abs": 0.0, "max_rel": 0.0,
               "why": None if same else "generated another number of tokens"}
    else:
        res = compare(got, want, TOLERANCE[dtype_name])
    if task == "train":
        # Losses within tol of their value (no absolute part); gradients as outputs.
        loss_rel = float(((got[0].double() - want[0].double()).abs()
                          / want[0].double().abs().clamp_min(1e-30)).max())
        rec["loss_rel"] = loss_rel
        if loss_rel > TOLERANCE[dtype_name] and res["ok"]:
            res.update(ok=False, why=f"losses differ by {loss_rel:.2e} of their value")
    numeric = res["why"] is None or res["why"].startswith("losses differ")
    if not res["ok"] and twin is not None and numeric:
        # Ill-conditioned models (BatchNorm over two values, deep nets with huge activations)
        # amplify last-bit differences: compare both devices' distance to a float64 run.
        try:
            with contextlib.redirect_stdout(sink):
                ref = work(twin.double(), _to(kw, "cpu", torch.float64), False)
            e_tpu, e_cpu = _distance(got, ref, TOLERANCE[dtype_name]), _distance(
                want, ref, TOLERANCE[dtype_name])
            rec.update(f64_distance_tpu=e_tpu, f64_distance_cpu=e_cpu)
            if e_tpu <= REFEREE_FACTOR * e_cpu or e_tpu <= 1.0:
                res.update(ok=True, why=None)
                rec["refereed"] = True
        except Exception as e:  # noqa: BLE001 - no float64 path: the comparison stands
            rec["referee_error"] = _message(e)
    rec.update(status="pass" if res["ok"] else "mismatch", elementwise=res["elementwise"],
               max_abs=res["max_abs"], max_rel=res["max_rel"], seconds=time.time() - t0,
               fallbacks=_fallbacks(torch_pjrt))
    if res["why"]:
        rec["error"] = res["why"]
    return rec


def _fallbacks(torch_pjrt):
    return {op: f for op, (_, f) in torch_pjrt.metrics()["ops"].items() if f}


def _message(e):
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def _worker(args):
    names = args.models
    with open(args.results, "a") as out:
        for name in names:
            out.write(json.dumps({"start": name}) + "\n")
            out.flush()
            def phase(p, out=out):
                out.write(json.dumps({"phase": p}) + "\n")
                out.flush()

            try:
                rec = run_one(name, args.mode, args.dtype, args.task, phase)
            except BaseException as e:  # noqa: BLE001 - keep the worker going
                rec = {"model": name, "status": "error", "error": _message(e),
                       "trace": traceback.format_exc()[-2000:]}
            out.write(json.dumps(rec) + "\n")
            out.flush()


# ------------------------------------------------------------------------------------------
# Running many, in workers

def run(names, mode="strict", dtype="float32", chunk=20, timeout=600, progress=True,
        task="forward", on_record=lambda rec: None):
    """Runs ``names`` in worker processes; returns one record per model, each also passed to
    ``on_record`` as soon as it is known."""
    env = dict(os.environ, **MODES[mode])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TORCH_TPU_WARN_FALLBACK", "0")
    records = {}
    todo = list(names)
    while todo:
        batch, todo = todo[:chunk], todo[chunk:]
        with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as f:
            path = f.name
        cmd = [sys.executable, "-m", "torch_pjrt.zoo", "--worker", "--mode", mode,
               "--dtype", dtype, "--task", task, "--results", path, "--models", *batch]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        err_tail = []
        current, started, on_tpu = None, time.time(), False

        def drain(p=proc, tail=err_tail):
            for line in p.stderr:
                tail.append(line)
                del tail[:-20]

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        seen = 0
        while True:
            done = proc.poll() is not None
            lines = open(path).read().splitlines()
            for line in lines[seen:]:
                rec = json.loads(line)
                if "start" in rec:
                    current, started, on_tpu = rec["start"], time.time(), False
                elif "phase" in rec:
                    on_tpu = rec["phase"] == "tpu"
                else:
                    records[rec["model"]] = rec
                    on_record(rec)
                    current = None
                    if progress:
                        _print_progress(rec, len(records), len(names))
            seen = len(lines)
            if done:
                break
            if current is not None and time.time() - started > timeout:
                proc.kill()
                proc.wait()
                records[current] = {"model": current, "mode": mode, "dtype": dtype, "task": task,
                                    "status": "timeout" if on_tpu else "cpu_error",
                                    "error": f"no result in {timeout} s"
                                             f"{'' if on_tpu else ' on the CPU'}"}
                on_record(records[current])
                if progress:
                    _print_progress(records[current], len(records), len(names))
                break
            time.sleep(0.2)
        reader.join(timeout=5)
        os.unlink(path)
        left = [n for n in batch if n not in records]
        if left and proc.returncode not in (None, 0) and left[0] == current:
            msg = "".join(err_tail).strip().splitlines()
            # A worker killed while the CPU ran the model (out of memory) is the CPU's failure.
            records[current] = {"model": current, "mode": mode, "dtype": dtype, "task": task,
                                "status": "crash" if on_tpu else "cpu_error",
                                "error": f"worker exit {proc.returncode}"
                                         f"{'' if on_tpu else ' on the CPU'}: "
                                         f"{msg[-1][:300] if msg else ''}"}
            on_record(records[current])
            if progress:
                _print_progress(records[current], len(records), len(names))
            left = left[1:]
        todo = left + todo
    return [records[n] for n in names if n in records]


def _print_progress(rec, i, n):
    extra = rec.get("error") or (f"max rel {rec['max_rel']:.2e}" if "max_rel" in rec else "")
    if "loss_rel" in rec:
        extra += f" losses rel {rec['loss_rel']:.2e}"
    fb = rec.get("fallbacks")
    fb = f" fallbacks: {','.join(sorted(fb))}" if fb else ""
    print(f"[{i}/{n}] {rec['model']:<48} {rec['status']:<16} {extra}{fb}", flush=True)


def summary(records):
    """Counts and rates over the models that run on the CPU."""
    counted = [r for r in records if r["status"] not in ("cpu_error", "nondeterministic")]
    n = len(counted)
    runs = sum(r["status"] in ("pass", "mismatch") for r in counted)
    passes = sum(r["status"] == "pass" for r in counted)
    no_fb = sum(r["status"] in ("pass", "mismatch") and not r.get("fallbacks") for r in counted)
    elementwise = sum(r["status"] == "pass" and r.get("elementwise", True) for r in counted)
    refereed = sum(r["status"] == "pass" and bool(r.get("refereed")) for r in counted)
    by = {}
    for r in records:
        by[r["status"]] = by.get(r["status"], 0) + 1
    pct = (lambda k: round(100.0 * k / n, 1)) if n else (lambda k: 0.0)
    return {"models": len(records), "run_on_cpu": n, "statuses": by,
            "run_pct": pct(runs), "match_pct": pct(passes), "zero_fallback_pct": pct(no_fb),
            "elementwise_match_pct": pct(elementwise), "refereed": refereed}


def table(records, s):
    lines = [f"{'model':<48} {'status':<16} detail"]
    for r in records:
        extra = r.get("error") or ""
        if "max_rel" in r and (r["status"] == "mismatch" or not r.get("elementwise", True)):
            extra = f"max rel diff {r['max_rel']:.3e} (abs {r['max_abs']:.3e}) {extra}"
        if r.get("refereed"):
            extra += (f" [refereed by float64: tpu {r['f64_distance_tpu']:.3g}, CPU "
                      f"{r['f64_distance_cpu']:.3g} tolerances away]")
        if r.get("fallbacks"):
            extra += f" [fallbacks: {', '.join(sorted(r['fallbacks']))}]"
        lines.append(f"{r['model']:<48} {r['status']:<16} {extra}")
    lines.append("")
    lines.append(f"{s['run_on_cpu']} of {s['models']} models run on the CPU; of those "
                 f"{s['run_pct']}% run on tpu, {s['match_pct']}% match "
                 f"({s['elementwise_match_pct']}% element by element, {s['refereed']} "
                 f"refereed by float64), "
                 f"{s['zero_fallback_pct']}% run with no CPU fallback; {s['statuses']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_pjrt.zoo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="hf,timm,tv", help="comma list of hf, timm, tv")
    p.add_argument("--sample", choices=["all", "ci", "train"], default="all")
    p.add_argument("--models", nargs="*", help="zoo names (hf:llama, timm:resnet18, tv:vgg11)")
    p.add_argument("--filter", default="", help="only names containing this")
    p.add_argument("--mode", choices=sorted(MODES), default="strict")
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    p.add_argument("--task", choices=sorted(TASKS), default="forward",
                   help="forward (eval, no grad); train (3 AdamW steps: losses and gradients); "
                        "generate (greedy model.generate, causal LMs and encoder-decoders; "
                        "-static: static KV cache; -sampled: top-k sampling, seeded)")
    p.add_argument("--chunk", type=int, default=20, help="models per worker process")
    p.add_argument("--timeout", type=float, default=600, help="seconds per model")
    p.add_argument("--json", help="write the records and summary here (and each record to "
                                   "FILE.jsonl as it comes)")
    p.add_argument("--resume", action="store_true",
                   help="with --json: skip the models FILE.jsonl already has for this mode, "
                        "dtype and task (a whole-zoo run interrupted), and count them")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.models:
        names = args.models
    elif args.sample == "ci":
        names = CI_SAMPLE
    elif args.sample == "train":
        names = TRAIN_TIER
    else:
        names = all_models(tuple(args.suite.split(",")))
    names = [n for n in names if args.filter in n]
    if args.resume and not args.json:
        p.error("--resume needs --json")
    done, log = {}, None
    if args.json:
        partial = args.json + ".jsonl"
        if args.resume and os.path.exists(partial):
            for line in open(partial).read().splitlines():
                rec = json.loads(line)
                if (rec.get("mode"), rec.get("dtype"), rec.get("task", "forward")) == (
                        args.mode, args.dtype, args.task):
                    done[rec["model"]] = rec
        log = open(partial, "a" if args.resume else "w")

    def on_record(rec):
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    t0 = time.time()
    fresh = run([n for n in names if n not in done], args.mode, args.dtype, args.chunk,
                args.timeout, task=args.task, on_record=on_record)
    by_name = {**done, **{r["model"]: r for r in fresh}}
    records = [by_name[n] for n in names if n in by_name]
    s = summary(records)
    s.update(mode=args.mode, dtype=args.dtype, task=args.task, seconds=round(time.time() - t0, 1),
             cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    print(table(records, s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
