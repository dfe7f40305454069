"""AIP_* and SageMaker accept environment keys in the config sources, and their precedence."""

from __future__ import annotations

from lmiserve.config.sources import load_settings


def test_aip_environment():
    s = load_settings(
        environ={
            "AIP_HTTP_PORT": "9001",
            "AIP_PREDICT_ROUTE": "/p",
            "AIP_HEALTH_ROUTE": "/h",
            "AIP_DEPLOYED_MODEL_ID": "7",
        }
    )
    assert (s.port, s.vertex_predict_route, s.vertex_health_route, s.vertex_deployed_model_id) == (
        9001,
        "/p",
        "/h",
        "7",
    )
    assert s.sources["port"] == "environment AIP_HTTP_PORT"


def test_port_precedence():
    both = load_settings(environ={"AIP_HTTP_PORT": "9001", "SAGEMAKER_BIND_TO_PORT": "9002"})
    assert both.port == 9002
    assert load_settings(environ={"AIP_HTTP_PORT": "9001", "SERVING_PORT": "9003"}).port == 9003
    assert load_settings({"port": 9004}, environ={"AIP_HTTP_PORT": "9001"}).port == 9004


def test_default_invocations_accept():
    assert (
        load_settings(environ={"SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "text/csv"}).default_invocations_accept
        == "text/csv"
    )
