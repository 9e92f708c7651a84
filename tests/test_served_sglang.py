"""The served engine's SGLang client against SGLang's documented request and answer shapes: SGLang does not install on
these CPUs, so a small stand-in on 127.0.0.1 answers ``/get_model_info``, ``/get_server_info`` and ``/generate``
(``input_ids``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``; ``meta_info.input_token_logprobs`` as
[logprob, id, text] a position, ``input_top_logprobs`` as lists of them) with a real float32 forward of the demo
teacher. Only the client is proven here, not a real SGLang server."""

import numpy as np
import pytest
import torch

from opdcache.backends import EngineConfig
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.format.validate import validate
from served_proxy import LoopbackServer


class StandIn(LoopbackServer):
    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.path = str(model_dir)
        self.requests = []
        self.start()

    def _answer(self, body: dict) -> dict:
        ids = body["input_ids"]
        start, k = body.get("logprob_start_len", 0), body.get("top_logprobs_num", 0)
        with torch.no_grad():
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)  # row j predicts ids[j + 1]
        asked = body.get("token_ids_logprob") or []
        toks, tops, ats = [], [], []
        for j in range(start, len(ids)):
            if j == 0:
                toks.append([None, ids[0], None])
                tops.append(None)
                ats.append(None)
                continue
            row = logp[j - 1]
            toks.append([float(row[ids[j]]), ids[j], None])
            top = row.topk(k) if k else None
            tops.append([[float(v), int(i), None] for v, i in zip(top.values, top.indices)] if k else None)
            ats.append([[float(row[i]), int(i), None] for i in asked] if asked else None)
        return {"text": "", "meta_info": {"input_token_logprobs": toks, "input_top_logprobs": tops,
                                          "input_token_ids_logprobs": ats,
                                          "output_token_logprobs": [], "finish_reason": {"type": "length"}}}

    def app(self):
        from aiohttp import web

        async def model_info(_):
            return web.json_response({"model_path": self.path, "is_generation": True})

        async def server_info(_):
            return web.json_response({"version": "0.4.0-standin", "context_length": 128})

        async def generate(request):
            body = await request.json()
            self.requests.append(body)
            return web.json_response(self._answer(body))

        app = web.Application()
        app.router.add_get("/get_model_info", model_info)
        app.router.add_get("/get_server_info", server_info)
        app.router.add_post("/generate", generate)
        return app


@pytest.fixture(scope="module")
def standin(weights):
    server = StandIn(weights / "teacher")
    yield server
    server.close()


def test_the_sglang_client_scores_a_cache_in_its_documented_shapes(standin, hf_cache, weights, tmp_path):
    import shutil

    from opdcache.teacher.scoring import ScoreJob, run_score

    cache = tmp_path / "c"
    shutil.copytree(hf_cache, cache)
    run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=6, slug="sg",
                       engine=EngineConfig(backend="server", server_url=standin.url, server_kind="sglang")))
    assert validate(cache) == []
    record = Cache(cache).table("teachers/sg")["model"]
    assert record["served"]["kind"] == "sglang" and record["served"]["version"] == "0.4.0-standin"
    body = standin.requests[-1]
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 6 and body["sampling_params"]["max_new_tokens"] == 0
    # the client carries the server's numbers unchanged: every stored value is the stand-in's own (a lone float32
    # forward of the row, as JSON), bit for bit, at its position; the top-k ids in the server's order
    for rpath, tpath in zip(Cache(cache).shard_paths("rollouts"), Cache(cache).shard_paths("teachers/sg")):
        r, t = shards.read_table(rpath), shards.read_table(tpath)
        off = shards.list_offsets(r["response_ids"])
        resp = shards.token_values(r["response_ids"])
        lp, kid, klp, rk = (shards.token_values(t[c]) for c in ("logprobs", "topk_ids", "topk_logprobs", "ref_topk_logprobs"))
        ref_ids = shards.token_values(r["ref_topk_ids"])
        for i, prompt in enumerate(r["prompt_ids"].to_pylist()):
            sl = slice(off[i], off[i + 1])
            with torch.no_grad():
                logp = torch.log_softmax(standin.model(torch.tensor([list(prompt) + resp[sl].tolist()])).logits[0].float(), -1)
            at = logp[len(prompt) - 1: len(prompt) - 1 + len(resp[sl])]
            np.testing.assert_array_equal(lp[sl], at.gather(1, torch.as_tensor(resp[sl], dtype=torch.long)[:, None])[:, 0].numpy())
            top = at.topk(6, -1)
            np.testing.assert_array_equal(kid[sl], top.indices.numpy())
            np.testing.assert_array_equal(klp[sl], top.values.numpy())
            np.testing.assert_array_equal(rk[sl], at.gather(1, torch.as_tensor(ref_ids[sl], dtype=torch.long)).numpy())


def test_the_sglang_client_refuses_an_answer_for_other_ids(standin, hf_cache, weights, tmp_path, monkeypatch):
    import shutil

    from opdcache.errors import OpdcacheError
    from opdcache.teacher.scoring import ScoreJob, run_score

    original = standin._answer

    def shifted(body):
        out = original(body)
        out["meta_info"]["input_token_logprobs"][-1][1] += 1
        return out

    monkeypatch.setattr(standin, "_answer", shifted)
    cache = tmp_path / "c"
    shutil.copytree(hf_cache, cache)
    with pytest.raises(OpdcacheError, match="the server answered for other token ids than it was sent"):
        run_score(ScoreJob(cache=cache, teacher=weights / "teacher", stores=("logprob",), slug="sg2",
                           engine=EngineConfig(backend="server", server_url=standin.url)))
    assert not list((cache / "teachers").glob("sg2/part-*.parquet"))
