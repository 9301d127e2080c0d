"""The step-cache and VAE options end to end: `Omni(...)` kwargs, the deploy config, `omnistage serve`
flags, and a request's `cache_config` in `extra_body` (the real openai client against uvicorn on
loopback, a tiny FLUX checkpoint on CPU): out of range is a 400 naming the field; in range the
server's image equals offline `Omni` with the same settings."""

import base64
import io

import numpy as np
import openai
import pytest
from live_server import live_server
from PIL import Image

from omnistage.entrypoints import cli

CACHE = {"cache_backend": "tea_cache", "cache_config": {"rel_l1_thresh": 0.5}}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from omnistage.testing import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("cache-server")), "flux")[0]


@pytest.fixture(scope="module")
def server(flux):
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(flux, device="cpu", dtype="float32", **CACHE)
    try:
        with live_server(build_app(engine, "tiny-flux"), timeout=120) as url, \
                openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            yield client
    finally:
        engine.close()


def _generate(client, cache_config):
    return client.images.generate(model="tiny-flux", prompt="a red cube", size="32x32",
                                  extra_body={"num_inference_steps": 5, "seed": 3, "cache_config": cache_config})


def test_request_cache_config_out_of_range_is_400_naming_the_field(server):
    with pytest.raises(openai.BadRequestError) as e:
        _generate(server, {"rel_l1_thresh": 99})
    assert e.value.body["param"] == "cache_config.rel_l1_thresh"
    assert "rel_l1_thresh must be a number in [0, 10]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _generate(server, {"Fn_compute_blocks": 2})
    assert e.value.body["param"] == "cache_config.Fn_compute_blocks"
    assert "allowed: rel_l1_thresh, coefficients" in e.value.body["message"]


def test_request_cache_config_matches_offline_omni(server, flux):
    from omnistage import DiffusionParams, Omni

    resp = _generate(server, {"rel_l1_thresh": 0.8})
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json))))
    with Omni(flux, device="cpu", dtype="float32", **CACHE) as omni:
        out = omni.generate("a red cube", DiffusionParams(height=32, width=32, num_inference_steps=5, seed=3,
                                                          cache_config={"rel_l1_thresh": 0.8}), use_tqdm=False)[0]
    assert out.metrics.cached_steps > 0
    assert np.array_equal(served, np.asarray(out.images[0]))


def test_deploy_config_sets_the_options_per_stage(flux):
    from omnistage.entrypoints.common import build_orchestrator

    deploy = {"stages": {"dit": {"cache_backend": "cache_dit", "cache_config": {"residual_diff_threshold": 0.1},
                                 "vae_use_tiling": True}}}
    orch = build_orchestrator(flux, "cpu", "float32", deploy_config=deploy)
    try:
        stage = orch.stages["dit"]
        assert stage.cache.backend == "cache_dit" and stage.cache.server_config == {"residual_diff_threshold": 0.1}
        assert stage.family.tile_threshold == 0
    finally:
        orch.close()
    with pytest.raises(ValueError, match="cache_backend must be one of tea_cache, cache_dit"):
        build_orchestrator(flux, "cpu", "float32", deploy_config={"stages": {"dit": {"cache_backend": "fbcache"}}})


def test_serve_flags_parse_and_bad_values_name_the_option(capsys):
    from omnistage.entrypoints.common import engine_kwargs_from_args

    args = cli.build_parser().parse_args(["serve", "m", "--cache-backend", "cache_dit", "--cache-config",
                                          '{"residual_diff_threshold": 0.12}', "--vae-use-tiling"])
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["cache_backend"] == "cache_dit" and kwargs["vae_use_tiling"] is True
    assert kwargs["cache_config"] == {"residual_diff_threshold": 0.12}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--cache-config", "{not json"])
    assert "--cache-config: not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--cache-backend", "teacache"])
    assert "--cache-backend: invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--cache-config: cache_config.rel_l1_thresh must be a number"):
        cli.main(["serve", "--cache-backend", "tea_cache", "--cache-config", '{"rel_l1_thresh": -1}'])
    with pytest.raises(SystemExit, match="--cache-config needs --cache-backend"):
        cli.main(["serve", "--cache-config", '{"rel_l1_thresh": 0.1}'])


def test_metrics_count_cached_steps(server):
    import httpx

    _generate(server, {"rel_l1_thresh": 0.8})
    text = httpx.get(str(server.base_url).replace("/v1/", "/metrics")).text
    line = next(l for l in text.splitlines() if l.startswith("omnistage:diffusion_cached_steps_total"))
    assert float(line.split()[-1]) > 0
