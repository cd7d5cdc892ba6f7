"""deploy/kserve (issue 31): the ClusterServingRuntime and the InferenceServices that use it.

Each manifest is validated against its KServe CRD's openAPIV3Schema, taken from the kserve
repository (github.com/kserve/kserve at aaac4e29, 2026-08-21, v0.20.0-rc0-104:
config/crd/full/serving.kserve.io_{clusterservingruntimes,inferenceservices}.yaml, the served
storage version's schema written as compact JSON, gzipped, into tests/data/kserve); then what
the schemas cannot say is read from the files: the protocols, and that the ports the
manifests route are the ports the service binds, beside the other manifests' image and token.
"""
import gzip
import json
from pathlib import Path

import jsonschema
import jsonschema_rs
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KSERVE = ROOT / "deploy" / "kserve"
SCHEMAS = ROOT / "tests" / "data" / "kserve"


def manifest(name: str) -> dict:
    return yaml.safe_load((KSERVE / name).read_text())


def schema(kind: str, version: str) -> dict:
    return json.loads(gzip.decompress((SCHEMAS / f"{kind}.{version}.json.gz").read_bytes()))


def port_of(bind: str) -> int:
    return int(bind.rsplit(":", 1)[1])


RUNTIME = manifest("runtime.yaml")
CONTAINER = RUNTIME["spec"]["containers"][0]
ENV = {item["name"]: item for item in CONTAINER["env"]}


@pytest.mark.parametrize("name", sorted(path.name for path in KSERVE.glob("*.yaml")))
def test_every_manifest_is_valid_against_its_kserve_crd(name):
    document = manifest(name)
    group, version = document["apiVersion"].split("/")
    assert group == "serving.kserve.io"
    crd = schema(document["kind"], version)
    jsonschema_rs.meta.validate(crd)  # the stored schema against its metaschema (jsonschema's check: 4 s)
    validator = jsonschema.validators.validator_for(crd)(crd)
    if (error := jsonschema.exceptions.best_match(validator.iter_errors(document))) is not None:
        raise error
    # The controls: the schema holds the manifest to something, at the top and inside spec.
    required = crd["properties"]["spec"]["required"]
    for wrong in ("not an object", {k: v for k, v in document["spec"].items() if k not in required}):
        assert not validator.is_valid({**document, "spec": wrong}), wrong


def test_the_runtime_serves_v2_over_rest_and_grpc_with_the_services_image_and_token():
    assert RUNTIME["kind"] == "ClusterServingRuntime"
    assert RUNTIME["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    assert CONTAINER["image"] == deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert ENV["BLOCKGRAD_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "blockgrad-api-token", "key": "token"}
    assert ENV["BLOCKGRAD_DASK_SCHEDULER"]["value"] == "off"  # jobs need deploy/k8s's store and cluster


def test_each_inference_service_routes_a_port_the_service_binds():
    """Serverless: the runtime's one declared port is REST's bind; the gRPC variant declares
    gRPC's bind in RawDeployment mode; the probes reach the HTTP port in both."""
    [declared] = CONTAINER["ports"]
    assert declared["containerPort"] == port_of(ENV["BLOCKGRAD_BIND"]["value"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert CONTAINER[probe]["httpGet"]["port"] == declared["containerPort"]
    assert {CONTAINER["readinessProbe"]["httpGet"]["path"], CONTAINER["livenessProbe"]["httpGet"]["path"]} == \
        {"/readyz", "/healthz"}
    for name in ("inferenceservice.yaml", "inferenceservice-grpc.yaml"):
        model = manifest(name)["spec"]["predictor"]["model"]
        assert model["runtime"] == RUNTIME["metadata"]["name"]
        assert model["modelFormat"]["name"] in {fmt["name"] for fmt in RUNTIME["spec"]["supportedModelFormats"]}
    grpc = manifest("inferenceservice-grpc.yaml")
    assert grpc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    [port] = grpc["spec"]["predictor"]["model"]["ports"]
    assert (port["name"], port["containerPort"]) == ("h2c", port_of(ENV["BLOCKGRAD_GRPC_BIND"]["value"]))
    assert manifest("inferenceservice.yaml")["metadata"]["name"] == "blockgrad"  # the model clients name
