"""The LM stage in its own process (`runner: process`): `AsyncOmni.reset_prefix_cache` crosses to
the stage process between its steps (`StageClient`'s optional verb), and a prompt cached before is
computed again after it; requests that arrive together are handed to the stage process at once
(`StageClient.add_requests`) and prefilled in one step, not one step each."""

import asyncio

import pytest

from omnistage.params import SamplingParams

PROMPT = ("The harbour town woke slowly, and the market filled with voices. Fishermen sorted the night's "
          "catch while the bakers opened their doors.")


@pytest.fixture(scope="module")
def engine(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32",
                       deploy_config={"stages": {"llm": {"runner": "process"}}})
    try:
        yield engine
    finally:
        engine.close()


def test_reset_reaches_a_stage_process(engine):

    async def cached_tokens() -> int:
        final = None
        async for final in engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0)):
            pass
        return final.num_cached_tokens

    async def scenario():
        first, again = await cached_tokens(), await cached_tokens()
        dropped = await engine.reset_prefix_cache()
        return first, again, dropped, await cached_tokens()

    assert type(engine.orchestrator.stages["llm"]).__name__ == "StageClient"
    first, again, dropped, after = asyncio.run(scenario())
    assert first == 0 and again >= 32 and dropped["llm"] >= 2 and after == 0


def test_requests_arriving_together_share_a_prefill_step(engine):
    """8 concurrent requests of 4 tokens, handed to the stage process at once: they take 4 steps (5 or
    6 when the engine thread picked up the first one or two before the others were queued; one step
    per request's prefill would be 4 + 7); one more, over the model length, is refused alone."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def one(i: int, prompt: str):
        final = None
        try:
            async for final in engine.generate(prompt, params, request_id=f"together-{i}"):
                pass
        except ValueError as e:
            return str(e)
        return len(final.outputs[0].token_ids)

    async def scenario():
        prompts = [f"{PROMPT} ({i})" for i in range(8)] + [PROMPT * 40]
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await asyncio.sleep(0.3)                # the stage's last stats reach the engine
        return results

    before = engine.stats().get("steps_total", 0)
    results = asyncio.run(scenario())
    assert results[:8] == [4] * 8 and "max_model_len" in results[8], results[8]
    assert engine.stats()["steps_total"] - before <= 4 + 2
