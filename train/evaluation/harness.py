"""The lm-evaluation-harness adapter (lm-eval 0.4.x, the optional extra `.[eval]`): a model `flashtrain`
that scores a flashtrain checkpoint on the harness's tasks.

    python launch/harness.py --model flashtrain --model_args checkpoint=CKPT --tasks hellaswag,arc_easy
    python launch/harness.py --model flashtrain --model_args checkpoint=IMPORTED,exp=flash --tasks ...

`launch/harness.py` is the harness's own command line (`lm_eval ...`, the same arguments) with this
model registered first: lm-eval 0.4 finds models only in its own registry, which importing this module
fills. From Python: `lm_eval.simple_evaluate(model=FlashtrainLM(checkpoint=...), tasks=[...])`.

`model_args`: `checkpoint` (a run's checkpoint: its config; or a weights-only import with `exp=NAME`),
`overrides` (config overrides separated by spaces, e.g. `model.use_triton=false`), `batch_size`.
One process, the whole model (no parallelism); on CUDA when there is one.

The three request types (lm_eval.api.model.LM), with `[BOS]` before every text as in training:
- `loglikelihood(context, continuation)`: log P(continuation | context), the sum over the
  continuation's tokens of the log-softmax of the model's logits at the position before each, and
  whether each is the greedy choice; context and continuation are encoded separately (trailing
  whitespace of the context moves to the continuation), the left of the context cut to the model's
  window (`data.seq_len`).
- `loglikelihood_rolling(text)`: the log-likelihood of the whole text in disjoint windows of
  `data.seq_len` (lm_eval.utils `get_rolling_token_windows`, prefix `[BOS]`).
- `generate_until(context, {until, max_gen_toks})`: greedy decoding, one full forward per token (no KV
  cache: small models and tests), stopped at EOS, at `max_gen_toks` or at the first `until` string.
Rows are right-padded with PAD to one length; causal attention makes the padding invisible to the
scored positions.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from flashtrain.data.tokenizer import load_tokenizer
from flashtrain.model.aux import StepStats
from flashtrain.train.evaluation.checkpoint import build_for_scoring, checkpoint_config

TEXT = -1  # the token type of text (data/images.py)


@register_model("flashtrain")
class FlashtrainLM(LM):
    def __init__(self, checkpoint: str, exp: str | None = None, overrides: str = "", batch_size: int | str = 1,
                 allow_damaged: bool | str = False, **_ignored):
        super().__init__()

        args = ([f"+exp={exp}"] if exp else []) + overrides.split()
        allow = str(allow_damaged).lower() in ("1", "true", "yes")  # model_args arrive as strings
        cfg, _ = checkpoint_config(checkpoint, args, allow)
        self.run, module, _ = build_for_scoring(cfg, checkpoint, allow)
        self.model = module.model.eval()
        self.spec = self.run.c.spec
        self.tok = load_tokenizer(self.run.tokenizer)
        self.window = self.run.c.data.seq_len
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self._device = self.run.device

    # --- the model ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    @torch.no_grad()
    def logits(self, rows: list[list[int]]) -> torch.Tensor:
        """fp32 logits [B, L, vocab] of token rows (right-padded with PAD to the longest)."""
        length = max(len(r) for r in rows)
        tokens = torch.full((len(rows), length), self.spec.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
        tokens = tokens.to(self._device)
        types = torch.full_like(tokens, TEXT)
        hidden = self.model.final_hidden(self.model.run(tokens, types, [[] for _ in rows], StepStats()))
        return self.model.head(hidden).float()

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log P(target tokens), all greedy) of (context, targets) token pairs, `batch_size` at a time."""
        out = []
        for b in range(0, len(pairs), self.batch_size):
            chunk = pairs[b:b + self.batch_size]
            rows = [(ctx + tgt)[:-1] for ctx, tgt in chunk]
            logp = torch.log_softmax(self.logits(rows).double(), dim=-1)
            for i, (ctx, tgt) in enumerate(chunk):
                at = len(ctx) - 1  # the position that predicts the first target token
                lp = logp[i, at:at + len(tgt)]
                target = torch.tensor(tgt, device=lp.device)
                out.append((lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())))
        return out

    # --- the harness's requests ------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            ctx, tgt = [self.spec.bos_id] + self.encode(context), self.encode(continuation)
            keep = self.window + 1 - len(tgt)  # the row is at most window + 1 tokens (window inputs)
            pairs.append((ctx[-keep:] if keep > 0 else ctx[-1:], tgt[-self.window:]))
        return self._cached(requests, "loglikelihood", self._score(pairs))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.encode(text), prefix_token=self.spec.bos_id, max_seq_len=self.window, context_len=1)]
            out.append(sum(lp for lp, _ in self._score(windows)))
        return self._cached(requests, "loglikelihood_rolling", out)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            row = ([self.spec.bos_id] + self.encode(context))[-self.window:]
            new: list[int] = []
            for _ in range(int(kwargs.get("max_gen_toks", 256))):
                nxt = int(self.logits([row[-self.window:]])[0, len(row[-self.window:]) - 1].argmax())
                if nxt == self.spec.eos_id:
                    break
                row.append(nxt)
                new.append(nxt)
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
            text = self.tok.decode(new)
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return self._cached(requests, "generate_until", out)

    def _cached(self, requests, kind: str, results: list) -> list:
        for req, res in zip(requests, results):
            self.cache_hook.add_partial(kind, req.args, res)
        return results
