"""GPT-2 decode in PyTorch with a static KV cache and the one-token step captured as a CUDA graph.

The twin of ferrograd's graph-replayed decode (`gpt sample`, crates/ferrograd-models/src/gpt/
sample.rs): the same design in PyTorch's own terms, PyTorch's best-case latency for batch-1
decoding without torch.compile. The step reads its token and position from fixed device buffers,
writes the new key and value at that position of caches allocated once at full length
(`index_copy_`), attends to the whole cache through a mask (`positions <= pos`) with
`F.scaled_dot_product_attention`, and writes the last logits into a fixed output buffer; it is
captured once with `torch.cuda.graph` and replayed for every token. Weights come from a Hugging
Face `GPT2LMHeadModel` (Conv1D `[in, out]` layouts), cast to the requested dtype once.

    dec = GraphDecoder(hf_model, capacity=131, dtype=torch.bfloat16)
    ms_median, ms_mean, tokens = dec.greedy(prompt_ids, new_tokens)

Each timed step is what ferrograd's is: set the token, replay, read the logits back to the host
(the sampler needs them there), pick the next token there.
"""
import statistics
import time

import torch
import torch.nn.functional as F


class GraphDecoder:
    def __init__(self, hf_model, capacity, dtype):
        cfg = hf_model.config
        self.h, self.c = cfg.n_head, cfg.n_embd
        self.d, self.eps, self.cap = self.c // self.h, cfg.layer_norm_epsilon, capacity
        sd = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
        dev = torch.device("cuda")
        w = lambda name: sd[name].detach().to(dev, dtype).contiguous()  # noqa: E731
        self.wte, self.wpe = w("wte.weight"), w("wpe.weight")
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            self.layers.append({n: w(p + n) for n in [
                "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                "mlp.c_proj.weight", "mlp.c_proj.bias"]})
        self.ln_f = (w("ln_f.weight"), w("ln_f.bias"))
        self.k = torch.zeros(cfg.n_layer, 1, self.h, capacity, self.d, device=dev, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.positions = torch.arange(capacity, device=dev)
        self.out = torch.empty(cfg.vocab_size, device=dev, dtype=torch.float32)
        self.graph = None

    @torch.no_grad()
    def _step(self):
        x = self.wte[self.tok] + self.wpe[self.pos]  # [1, C]
        mask = (self.positions <= self.pos).view(1, 1, 1, self.cap)
        for i, L in enumerate(self.layers):
            a = F.layer_norm(x, (self.c,), L["ln_1.weight"], L["ln_1.bias"], self.eps)
            qkv = torch.addmm(L["attn.c_attn.bias"], a, L["attn.c_attn.weight"]).view(3, self.h, self.d)
            self.k[i][0].index_copy_(1, self.pos, qkv[1].view(self.h, 1, self.d))
            self.v[i][0].index_copy_(1, self.pos, qkv[2].view(self.h, 1, self.d))
            y = F.scaled_dot_product_attention(qkv[0].view(1, self.h, 1, self.d), self.k[i], self.v[i], attn_mask=mask)
            x = x + torch.addmm(L["attn.c_proj.bias"], y.view(1, self.c), L["attn.c_proj.weight"])
            m = F.layer_norm(x, (self.c,), L["ln_2.weight"], L["ln_2.bias"], self.eps)
            m = F.gelu(torch.addmm(L["mlp.c_fc.bias"], m, L["mlp.c_fc.weight"]), approximate="tanh")
            x = x + torch.addmm(L["mlp.c_proj.bias"], m, L["mlp.c_proj.weight"])
        x = F.layer_norm(x, (self.c,), *self.ln_f, self.eps)
        self.out.copy_((x @ self.wte.t()).view(-1))

    def _run(self, tok, pos):
        self.tok.fill_(tok)
        self.pos.fill_(pos)
        if self.graph is None:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):  # idempotent: the same row gets the same key and value
                    self._step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
        self.graph.replay()
        return self.out.cpu()

    def greedy(self, prompt, new_tokens):
        """Median and mean ms per decode step, and the tokens chosen (the prompt runs through the
        same graph, one token at a time)."""
        self.k.zero_()
        self.v.zero_()
        for p, t in enumerate(prompt):
            logits = self._run(t, p)
        out, times = [int(logits.argmax())], []
        for p in range(len(prompt), len(prompt) + new_tokens - 1):
            t0 = time.perf_counter()
            logits = self._run(out[-1], p)
            out.append(int(logits.argmax()))
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times), 1e3 * statistics.mean(times), out
