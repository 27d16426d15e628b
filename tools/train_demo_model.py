#!/usr/bin/env python3
"""Train the small bundled Mixture-of-Experts demo model for colibri-format.

No MoE checkpoint can be downloaded in our environment, so we train our own:
a tiny ``Qwen3MoeForCausalLM`` (transformers' own model class) on the CPython
standard library's Python sources, with a byte-level BPE vocabulary trained by
the ``tokenizers`` library.  The result is a regular Hugging Face checkpoint
(bf16 safetensors) that the converter and the runtime can consume.

Pipeline (every stage is seeded and deterministic given the same inputs):

1. corpus   -- a sorted, filtered list of ``.py`` files from the stdlib.  A
               fixed set of modules (and their unit tests) is held out and
               written as ``eval.txt``.
2. tokenizer-- byte-level BPE trained on the training files only.
3. encode   -- documents become ``<|bos|> text <|eos|>`` and are packed
               into one long uint16 token stream.
4. train    -- AdamW + linear warm-up + cosine decay, router aux loss on,
               bf16 autocast on CUDA.  The step count is capped by ``--steps``
               and by ``--time-budget`` (seconds of training loop).
5. report   -- held-out loss/perplexity, per-layer routing distribution on
               held-out text (a collapsed router is flagged and makes the
               script exit non-zero unless ``--allow-collapse``), a greedy
               sample, and the files of a standard HF checkpoint.

Stages 1-3 can be run once with ``--prepare-only --data-cache DIR`` and the
cache reused with ``--data-cache DIR`` (e.g. to train on a GPU machine whose
Python has another stdlib version, or no test suite installed).

Example::

    python tools/train_demo_model.py --prepare-only --data-cache .democache
    python tools/train_demo_model.py --data-cache .democache --out out/demo \
        --device cuda --steps 2600 --time-budget 230
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------
# constants
# --------------------------------------------------------------------------

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4

# Modules held out from training (together with their tests); their sources
# form eval.txt.  Paths are relative to the stdlib root.
HELDOUT_MODULES = [
    "bisect.py",
    "colorsys.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "json/scanner.py",
    "json/tool.py",
    "queue.py",
    "sched.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
]
EVAL_MAX_BYTES = 300_000

# Directories never used (generated tables, vendored tools, GUI demos, ...).
EXCLUDED_TOP = {
    "site-packages", "idlelib", "lib2to3", "ensurepip", "encodings",
    "pydoc_data", "turtledemo", "lib-dynload", "__pycache__", "__phello__",
    "distutils",
}
TEST_DIR_NAMES = {"test", "tests", "idle_test"}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def log(msg: str) -> None:
    print(f"[train_demo_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------

def _is_test_path(rel: Path) -> bool:
    return any(part in TEST_DIR_NAMES for part in rel.parts[:-1])


def _clean_source(text: str) -> str | None:
    """Return the text if it looks like ordinary Python source, else None."""
    if not text.strip():
        return None
    lines = text.splitlines()
    if max(len(line) for line in lines) > 400:
        return None  # embedded data blobs
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    if non_ascii > 0.01 * len(text):
        return None  # mostly unicode test tables
    return text.replace("\r\n", "\n")


def collect_corpus(stdlib: Path, corpus: str, max_file_bytes: int = 250_000):
    """Return (train_docs, heldout_docs, manifest) -- lists of (relpath, text)."""
    heldout = set(HELDOUT_MODULES)
    heldout_stems = {Path(m).stem if Path(m).stem != "__init__" else Path(m).parent.name
                     for m in HELDOUT_MODULES}
    heldout_test_prefixes = tuple(f"test_{s}" for s in sorted(heldout_stems))

    all_files = sorted(p.relative_to(stdlib) for p in stdlib.rglob("*.py"))
    train, held, skipped = [], [], []
    for rel in all_files:
        top = rel.parts[0]
        if top in EXCLUDED_TOP or top.startswith("config-") or top.startswith("_sysconfigdata"):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        relp = rel.as_posix()
        is_test = _is_test_path(rel)
        if relp in heldout:
            held.append(relp)
            continue
        if is_test:
            if corpus == "core":
                continue
            # keep unit tests of held-out modules out of training as well
            if any(part.startswith(heldout_test_prefixes) for part in rel.parts):
                continue
        train.append(relp)

    if corpus == "tiny":
        train = [p for p in train if not _is_test_path(Path(p))][:40]

    def read(relp):
        path = stdlib / relp
        if path.stat().st_size > max_file_bytes:
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return None
        return _clean_source(text)

    train_docs = []
    for relp in train:
        t = read(relp)
        if t is None:
            skipped.append(relp)
        else:
            train_docs.append((relp, t))
    held_docs = []
    total = 0
    for relp in held:
        t = (stdlib / relp).read_text(encoding="utf-8").replace("\r\n", "\n")
        if total + len(t.encode()) > EVAL_MAX_BYTES:
            break
        held_docs.append((relp, t))
        total += len(t.encode())
    return train_docs, held_docs, skipped


def eval_text_from_docs(held_docs) -> str:
    parts = []
    for relp, text in held_docs:
        parts.append(f"# ===== Lib/{relp} =====\n{text}")
    return "\n".join(parts)


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------

def train_tokenizer(train_docs, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((t for _, t in train_docs), trainer=trainer, length=len(train_docs))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    add_bos_post_processor(tok)
    return tok


def add_bos_post_processor(tok):
    """`tokenizer(text)` prepends <|bos|>, as every training document starts with it."""
    from tokenizers import processors

    bos_id = SPECIAL_TOKENS.index(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])


def encode_docs(tok, docs) -> np.ndarray:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
    total = sum(len(e.ids) + 2 for e in encs)
    out = np.empty(total, dtype=np.uint16)
    pos = 0
    for e in encs:
        n = len(e.ids)
        out[pos] = bos
        out[pos + 1: pos + 1 + n] = e.ids
        out[pos + 1 + n] = eos
        pos += n + 2
    return out


def prepare_data(args) -> dict:
    """Build (or load) corpus, tokenizer and token ids.  Returns a dict."""
    cache = Path(args.data_cache) if args.data_cache else None
    if cache and (cache / "manifest.json").exists() and not args.prepare_only:
        log(f"loading prepared data from {cache}")
        from tokenizers import Tokenizer
        manifest = json.loads((cache / "manifest.json").read_text())
        tok = Tokenizer.from_file(str(cache / "tokenizer.json"))
        add_bos_post_processor(tok)
        return {
            "tokenizer": tok,
            "train_ids": np.load(cache / "train_ids.npy"),
            "eval_text": (cache / "eval.txt").read_text(encoding="utf-8"),
            "manifest": manifest,
        }

    stdlib = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    t0 = time.time()
    train_docs, held_docs, skipped = collect_corpus(stdlib, args.corpus)
    train_bytes = sum(len(t.encode()) for _, t in train_docs)
    log(f"corpus '{args.corpus}' from {stdlib}: {len(train_docs)} train files "
        f"({train_bytes / 1e6:.2f} MB), {len(held_docs)} held-out files, "
        f"{len(skipped)} skipped; {time.time() - t0:.1f}s")
    eval_text = eval_text_from_docs(held_docs)

    t0 = time.time()
    tok = train_tokenizer(train_docs, args.vocab_size)
    tok_time = time.time() - t0
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {tok_time:.1f}s")
    t0 = time.time()
    train_ids = encode_docs(tok, train_docs)
    log(f"encoded {len(train_ids):,} train tokens in {time.time() - t0:.1f}s "
        f"({train_bytes / max(1, len(train_ids)):.2f} bytes/token)")

    h = hashlib.sha256()
    for relp, text in train_docs:
        h.update(relp.encode() + b"\0" + text.encode() + b"\0")
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_path": str(stdlib),
        "corpus": args.corpus,
        "train_files": len(train_docs),
        "train_bytes": train_bytes,
        "train_tokens": int(len(train_ids)),
        "train_sha256": h.hexdigest(),
        "train_file_list": [p for p, _ in train_docs],
        "skipped_files": skipped,
        "heldout_files": [p for p, _ in held_docs],
        "eval_bytes": len(eval_text.encode()),
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "tokenizer_train_seconds": round(tok_time, 2),
        "seed": args.seed,
    }
    if cache:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(cache / "tokenizer.json"))
        np.save(cache / "train_ids.npy", train_ids)
        (cache / "eval.txt").write_text(eval_text, encoding="utf-8")
        (cache / "manifest.json").write_text(json.dumps(manifest, indent=1))
        log(f"wrote prepared data to {cache}")
    return {"tokenizer": tok, "train_ids": train_ids, "eval_text": eval_text, "manifest": manifest}


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------

def make_config(args, vocab_size: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.moe_intermediate,  # unused: every layer is MoE
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max(2048, args.seq_len),
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,
        initializer_range=0.02,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        use_cache=True,
    )


def param_count_from_config(c) -> int:
    h, v, L = c.hidden_size, c.vocab_size, c.num_hidden_layers
    hd = c.head_dim
    attn = h * c.num_attention_heads * hd * 2 + h * c.num_key_value_heads * hd * 2 + 2 * hd
    experts = c.num_experts * 3 * h * c.moe_intermediate_size
    router = c.num_experts * h
    norms = 2 * h
    emb = v * h * (1 if c.tie_word_embeddings else 2)
    return emb + L * (attn + experts + router + norms) + h


# --------------------------------------------------------------------------
# evaluation helpers
# --------------------------------------------------------------------------

def evaluate(model, ids: np.ndarray, seq_len: int, device, autocast, batch: int = 16):
    """Mean next-token cross-entropy and per-layer expert load on `ids`."""
    import torch
    import torch.nn.functional as F

    model.eval()
    n_seq = max(1, (len(ids) - 1) // seq_len)
    usable = n_seq * seq_len + 1
    ids = ids[:usable] if len(ids) >= usable else ids
    total_loss, total_tok = 0.0, 0
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, n_seq, batch):
            rows = []
            for j in range(s, min(n_seq, s + batch)):
                a = j * seq_len
                chunk = ids[a: a + seq_len + 1]
                if len(chunk) < 2:
                    continue
                rows.append(torch.from_numpy(chunk.astype(np.int64)))
            L = min(len(r) for r in rows)
            x = torch.stack([r[:L] for r in rows]).to(device)
            with autocast():
                out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
            logits = out.logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                   reduction="sum")
            total_loss += loss.item()
            total_tok += x[:, 1:].numel()
            for li, rl in enumerate(out.router_logits):
                top = torch.topk(rl.float(), cfg.num_experts_per_tok, dim=-1).indices
                counts[li] += torch.bincount(top.reshape(-1).cpu(),
                                             minlength=cfg.num_experts).double()
    model.train()
    mean = total_loss / max(1, total_tok)
    frac = (counts / counts.sum(dim=1, keepdim=True)).tolist()
    return mean, total_tok, frac


def per_layer_balance_loss(router_logits, top_k: int, num_experts: int):
    """Switch-style load-balancing loss computed separately for every layer.

    For each layer: E * sum_i f_i * P_i, where f_i is the share of the top-k
    assignments that went to expert i and P_i the mean router probability of
    expert i.  A perfectly balanced layer scores 1.0.  (transformers' built-in
    aux loss pools all layers together, which lets one layer keep a dead expert
    while another compensates -- our first H200 run did exactly that.)
    Returns a tensor of shape (num_layers,).
    """
    import torch
    import torch.nn.functional as F

    out = []
    for rl in router_logits:
        probs = F.softmax(rl.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        share = F.one_hot(chosen, num_experts).float().sum(dim=1).mean(dim=0) / top_k
        out.append(num_experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(out)


def pick_experts_impl(model, device, use_amp, seq_len):
    """Keep the library's default experts kernel if a forward+backward works, else use eager."""
    import torch

    x = torch.randint(5, model.config.vocab_size, (2, min(64, seq_len)), device=device,
                      generator=torch.Generator(device=device).manual_seed(0))
    current = getattr(model.config, "_experts_implementation", None)
    for impl in (current, "eager"):
        try:
            if impl != current:
                if hasattr(model, "set_experts_implementation"):
                    model.set_experts_implementation(impl)
                else:
                    model.config._experts_implementation = impl
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                out = model(input_ids=x, output_router_logits=True, use_cache=False)
            loss = out.logits.float().logsumexp(-1).mean() + out.aux_loss.float()
            loss.backward()
            ok = bool(torch.isfinite(loss).item())
            model.zero_grad(set_to_none=True)
            if ok:
                return impl
            log(f"experts implementation {impl!r} gave a non-finite loss")
        except Exception as e:  # noqa: BLE001 -- any kernel failure means: try the next one
            model.zero_grad(set_to_none=True)
            log(f"experts implementation {impl!r} failed: {type(e).__name__}: {str(e)[:200]}")
    raise RuntimeError("no working experts implementation")


def first_tokens_loss(model, ids: np.ndarray, seq_len: int = 512, n_seq: int = 4) -> float:
    """CE over the first n_seq*seq_len+1 tokens, fp32 on CPU -- what tests/test_demo_model.py checks."""
    import torch
    import torch.nn.functional as F

    need = n_seq * seq_len + 1
    x = torch.from_numpy(ids[:need].astype(np.int64))
    inp = x[:-1].view(n_seq, seq_len)
    tgt = x[1:].view(n_seq, seq_len)
    with torch.no_grad():
        logits = model(input_ids=inp, use_cache=False).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1)).item()


def routing_verdict(frac, max_share: float, min_share: float):
    problems = []
    for li, row in enumerate(frac):
        if max(row) > max_share:
            problems.append(f"layer {li}: expert {int(np.argmax(row))} gets {max(row):.1%} > {max_share:.0%}")
        if min(row) < min_share:
            problems.append(f"layer {li}: expert {int(np.argmin(row))} gets {min(row):.2%} < {min_share:.0%}")
    return problems


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", help="output checkpoint directory")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=1234)
    # data
    p.add_argument("--stdlib", default=None, help="stdlib root (default: sysconfig stdlib)")
    p.add_argument("--corpus", default="full", choices=["full", "core", "tiny"],
                   help="full: stdlib modules + test suite; core: modules only; tiny: 40 files (smoke test)")
    p.add_argument("--data-cache", default=None, help="directory to write/read prepared data")
    p.add_argument("--prepare-only", action="store_true", help="only build the data cache")
    p.add_argument("--vocab-size", type=int, default=4096)
    # model
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=160)
    p.add_argument("--aux-coef", type=float, default=0.01,
                   help="weight of the per-layer load-balancing loss (summed over layers)")
    p.add_argument("--max-mib", type=float, default=15.75,
                   help="refuse configs whose bf16 weights exceed this many MiB")
    # training
    p.add_argument("--steps", type=int, default=2600, help="maximum optimizer steps")
    p.add_argument("--time-budget", type=float, default=230.0,
                   help="seconds for the training loop; steps are reduced to fit (0 = no limit)")
    p.add_argument("--calib-steps", type=int, default=30,
                   help="steps timed to fit the schedule into --time-budget")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--experts-impl", default=None,
                   help="transformers experts_implementation (default: library default)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500,
                   help="held-out loss/routing every N steps (multiple of --log-every; 0 = only at the end)")
    p.add_argument("--eval-tokens", type=int, default=0, help="limit held-out tokens (0 = all)")
    p.add_argument("--max-share", type=float, default=0.5)
    p.add_argument("--min-share", type=float, default=0.01)
    p.add_argument("--allow-collapse", action="store_true")
    args = p.parse_args(argv)
    if not args.prepare_only and not args.out:
        p.error("--out is required unless --prepare-only")
    if args.prepare_only and not args.data_cache:
        p.error("--prepare-only needs --data-cache")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    wall0 = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)

    data = prepare_data(args)
    if args.prepare_only:
        return 0

    import torch
    import torch.nn.functional as F
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM, GenerationConfig

    torch.manual_seed(args.seed)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            log("CUDA requested but not available")
            return 2
        torch.cuda.manual_seed_all(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = torch.device(args.device)

    tok = data["tokenizer"]
    vocab = tok.get_vocab_size()
    config = make_config(args, vocab)
    n_params = param_count_from_config(config)
    bf16_bytes = 2 * n_params
    log(f"model: {n_params:,} params -> {bf16_bytes / 2**20:.2f} MiB in bf16 "
        f"(limit {args.max_mib} MiB)")
    if bf16_bytes > args.max_mib * 2**20:
        log(f"model too large: {bf16_bytes / 2**20:.2f} MiB in bf16 over --max-mib {args.max_mib}")
        return 2

    kw = {}
    if args.experts_impl:
        kw["experts_implementation"] = args.experts_impl
    model = Qwen3MoeForCausalLM._from_config(config, **kw) if kw else Qwen3MoeForCausalLM(config)
    real_params = sum(p.numel() for p in model.parameters())
    assert real_params == n_params, (real_params, n_params)
    model.to(device)
    model.train()
    use_amp = args.device == "cuda"
    if not args.experts_impl:
        pick_experts_impl(model, device, use_amp, args.seq_len)
    log(f"experts implementation: {getattr(model.config, '_experts_implementation', None)}; "
        f"attention: {model.config._attn_implementation}")

    def autocast():
        if use_amp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    fwd = torch.compile(model) if args.compile else model

    decay, no_decay = [], []
    for n, p_ in model.named_parameters():
        (no_decay if p_.ndim < 2 or "norm" in n else decay).append(p_)
    opt_kw = {"fused": True} if args.device == "cuda" else {}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kw)

    ids = data["train_ids"]
    n_tokens = len(ids)
    T, B = args.seq_len, args.batch
    n_windows = (n_tokens - 1) // T
    if n_windows < 1:
        raise SystemExit("corpus too small for one sequence")
    gen = np.random.default_rng(args.seed)
    ids_t = torch.from_numpy(ids.astype(np.int64))

    def batch_iter():
        # epoch-wise shuffled, non-overlapping windows with a random phase
        while True:
            phase = int(gen.integers(0, T))
            nw = (n_tokens - 1 - phase) // T
            order = gen.permutation(nw)
            for s in range(0, nw - B + 1, B):
                starts = phase + order[s: s + B] * T
                idx = torch.from_numpy(starts).unsqueeze(1) + torch.arange(T + 1)
                yield ids_t[idx]

    batches = batch_iter()
    eval_text = data["eval_text"]
    eval_ids = np.array([SPECIAL_TOKENS.index(BOS)] + tok.encode(eval_text, add_special_tokens=False).ids,
                        dtype=np.int64)
    if args.eval_tokens:
        eval_ids = eval_ids[: args.eval_tokens]
    total_steps = args.steps

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))

    log(f"training: {n_tokens:,} tokens, batch {B}x{T} = {B * T:,} tokens/step, "
        f"max steps {args.steps}, budget {args.time_budget}s, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if use_amp else ""))
    train_t0 = time.time()
    calib_t0 = None
    step = 0
    tokens_seen = 0
    history = []
    while step < total_steps:
        x = next(batches).to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with autocast():
            out = fwd(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        logits = out.logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        per_layer = per_layer_balance_loss(out.router_logits, config.num_experts_per_tok,
                                           config.num_experts)
        aux = per_layer.sum()
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += B * T

        if step == 3:  # skip warm-up/allocation steps in the calibration
            if use_amp:
                torch.cuda.synchronize()
            calib_t0 = time.time()
        if step == 3 + args.calib_steps and args.time_budget > 0:
            if use_amp:
                torch.cuda.synchronize()
            per_step = (time.time() - calib_t0) / args.calib_steps
            elapsed = time.time() - train_t0
            fit = int((args.time_budget - elapsed) / (per_step * 1.08)) + step
            if fit < total_steps:
                total_steps = max(step + 1, fit)
            log(f"calibration: {per_step * 1000:.1f} ms/step, {B * T / per_step:,.0f} tokens/s "
                f"-> total steps {total_steps} (~{total_steps * B * T / n_tokens:.1f} epochs)")

        if step % args.log_every == 0 or step == total_steps or step == 1:
            cv = ce.item()
            pl = per_layer.detach().float().cpu().tolist()
            el = time.time() - train_t0
            rec = {"step": step, "ce": round(cv, 4), "aux_per_layer_max": round(max(pl), 4),
                   "lr": lr_at(step - 1), "elapsed_s": round(el, 1)}
            msg = (f"step {step:5d}/{total_steps} ce {cv:.4f} aux/layer mean {np.mean(pl):.3f} "
                   f"max {max(pl):.3f} gnorm {float(gnorm):.2f} lr {lr_at(step - 1):.2e} "
                   f"{tokens_seen / el:,.0f} tok/s  {el:.0f}s")
            if args.eval_every and (step % args.eval_every == 0 or step == total_steps):
                hl, _, fr = evaluate(model, eval_ids, T, device, autocast)
                rec["heldout_loss"] = round(hl, 4)
                rec["heldout_min_expert_share"] = round(min(min(r) for r in fr), 4)
                rec["heldout_max_expert_share"] = round(max(max(r) for r in fr), 4)
                msg += (f" | held-out {hl:.4f} expert share min {rec['heldout_min_expert_share']:.2%}"
                        f" max {rec['heldout_max_expert_share']:.2%}")
            history.append(rec)
            log(msg)
    if use_amp:
        torch.cuda.synchronize()
    train_time = time.time() - train_t0
    final_ce = ce.item()
    log(f"training done: {step} steps, {tokens_seen:,} tokens in {train_time:.1f}s")

    # ---------------------------------------------------------------- eval
    ev_loss, ev_tok, frac = evaluate(model, eval_ids, T, device, autocast)
    ppl = math.exp(ev_loss)
    log(f"held-out: {ev_tok:,} tokens, loss {ev_loss:.4f}, perplexity {ppl:.2f}")
    for li, row in enumerate(frac):
        log(f"routing layer {li}: " + " ".join(f"{v:5.1%}" for v in row))
    problems = routing_verdict(frac, args.max_share, args.min_share)
    for pr in problems:
        log(f"ROUTER COLLAPSE: {pr}")

    # ---------------------------------------------------------------- save
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model_bf16 = model.to(torch.bfloat16).cpu()
    model_bf16.config.dtype = "bfloat16"
    model_bf16.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, do_sample=False, max_new_tokens=128)
    model_bf16.save_pretrained(out, safe_serialization=True)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END], model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    (out / "eval.txt").write_text(eval_text, encoding="utf-8")

    # greedy sample from the bf16 checkpoint (also checks the saved weights)
    prompt = "def fibonacci(n):\n"
    enc = hf_tok(prompt, return_tensors="pt", add_special_tokens=False)
    x = torch.cat([torch.tensor([[config.bos_token_id]]), enc.input_ids], dim=1)
    with torch.no_grad():
        g = model_bf16.generate(x, max_new_tokens=48, do_sample=False)
    sample = hf_tok.decode(g[0, 1:], skip_special_tokens=False)
    log("sample:\n" + sample)

    model_f32 = model_bf16.float()
    first2k = first_tokens_loss(model_f32, eval_ids)
    log(f"held-out first 2049 tokens (4x512, fp32 from bf16 weights, CPU): loss {first2k:.4f}")

    st = out / "model.safetensors"
    report = {
        "model": "colibri-demo-moe",
        "architecture": "Qwen3MoeForCausalLM",
        "params": n_params,
        "bf16_weight_bytes": bf16_bytes,
        "model_safetensors_bytes": st.stat().st_size,
        "config": {k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "norm_topk_prob", "tie_word_embeddings", "router_aux_loss_coef")},
        "training": {
            "command": "python3 tools/train_demo_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "seed": args.seed,
            "steps": step,
            "max_steps": args.steps,
            "batch_sequences": B,
            "seq_len": T,
            "tokens_per_step": B * T,
            "tokens_seen": tokens_seen,
            "epochs": round(tokens_seen / n_tokens, 2),
            "lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup,
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
            "optimizer": "AdamW(betas=(0.9, 0.95))", "schedule": "linear warm-up + cosine",
            "aux_loss": f"per-layer Switch-style load balancing (1.0 = balanced), summed over layers, x {args.aux_coef}",
            "precision": "bf16 autocast, fp32 master weights" if use_amp else "fp32",
            "final_train_ce": round(final_ce, 4),
            "train_ce_history": history,
            "train_loop_seconds": round(train_time, 1),
            "tokens_per_second": round(tokens_seen / train_time),
        },
        "heldout": {
            "file": "eval.txt",
            "tokens": ev_tok,
            "seq_len": T,
            "loss": round(ev_loss, 4),
            "perplexity": round(ppl, 3),
            "bytes_per_token": round(len(eval_text.encode()) / len(eval_ids), 3),
            "first_2049_tokens_loss_cpu_fp32": round(first2k, 4),
            "first_2049_tokens_note": "<|bos|> + eval.txt tokens, 4 windows of 512, bf16 weights upcast to fp32",
        },
        "routing": {
            "measured_on": "eval.txt, top-k assignments per layer (fractions sum to 1 per layer)",
            "fraction_per_expert": [[round(v, 4) for v in row] for row in frac],
            "collapse_thresholds": {"max_share": args.max_share, "min_share": args.min_share},
            "collapsed": bool(problems),
            "problems": problems,
        },
        "data": {k: v for k, v in data["manifest"].items() if k != "train_file_list"},
        "sample": {"prompt": prompt, "greedy_completion": sample},
        "device": torch.cuda.get_device_name(0) if use_amp else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "wall_time_seconds": None,
    }
    report["wall_time_seconds"] = round(time.time() - wall0, 1)
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {out}: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.2f}MiB"
                                      for p in sorted(out.iterdir())))
    log(f"total wall time {report['wall_time_seconds']}s")
    file_limit_mib = math.ceil(args.max_mib)  # the tensors' bound plus the header, rounded up to a whole MiB
    if st.stat().st_size > file_limit_mib * 2**20:
        log(f"model.safetensors exceeds {file_limit_mib} MiB")
        return 3
    if problems and not args.allow_collapse:
        log("router collapse detected; refusing (use --allow-collapse to keep the result)")
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
