"""`AsyncOmni.reset_prefix_cache` with the LM stage in its own process (`runner: process`): the call
crosses to the stage process between its steps (`StageClient`'s optional verb), and a prompt cached
before is computed again after it."""

import asyncio

from omnistage.params import SamplingParams

PROMPT = ("The harbour town woke slowly, and the market filled with voices. Fishermen sorted the night's "
          "catch while the bakers opened their doors.")


def test_reset_reaches_a_stage_process(tiny_models):
    from omnistage.entrypoints.async_omni import AsyncOmni

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32",
                       deploy_config={"stages": {"llm": {"runner": "process"}}})

    async def cached_tokens() -> int:
        final = None
        async for final in engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0)):
            pass
        return final.num_cached_tokens

    async def scenario():
        first, again = await cached_tokens(), await cached_tokens()
        dropped = await engine.reset_prefix_cache()
        return first, again, dropped, await cached_tokens()

    try:
        assert type(engine.orchestrator.stages["llm"]).__name__ == "StageClient"
        first, again, dropped, after = asyncio.run(scenario())
        assert first == 0 and again >= 32 and dropped["llm"] >= 2 and after == 0
    finally:
        engine.close()
