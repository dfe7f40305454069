"""Deploy the lmiserve image to a SageMaker real-time endpoint with boto3 (bring your own container).

    # 1. the image, in ECR (SageMaker pulls only from ECR):
    docker build -t lmiserve . && docker tag lmiserve $ECR/lmiserve:latest && docker push $ECR/lmiserve:latest
    # 2. optionally the model, as model.tar.gz with the model files and serving.properties at its root
    #    (SageMaker extracts it to /opt/ml/model, which the entrypoint serves):
    tar -czf model.tar.gz -C my-model . && aws s3 cp model.tar.gz s3://my-bucket/lmiserve/model.tar.gz
    # 3. the endpoint:
    python deploy/sagemaker/deploy.py --image $ECR/lmiserve:latest --role arn:aws:iam::123456789012:role/SageMakerRole \
        --model-data s3://my-bucket/lmiserve/model.tar.gz --name lmiserve-smollm
    # without --model-data the endpoint serves the model baked into the image.

`--dry-run` prints the CreateModel, CreateEndpointConfig and CreateEndpoint requests as JSON instead
of sending them (needs no boto3 and no credentials). Invoke the endpoint with:

    aws sagemaker-runtime invoke-endpoint --endpoint-name lmiserve-smollm --content-type application/json \
        --cli-binary-format raw-in-base64-out \
        --body '{"inputs": "Deep learning is", "parameters": {"max_new_tokens": 32}}' out.json

SageMaker stops a container with SIGTERM and kills it 30 s later: lmiserve's drain_timeout (25 s by
default) lets the requests in flight finish within that.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def requests(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The three API requests, by operation name."""
    environment = {"OPTION_DRAIN_TIMEOUT": "25"}  # any OPTION_<KEY> (or SERVING_<KEY>) setting goes here
    if args.model_name:
        environment["OPTION_MODEL_NAME"] = args.model_name
    if args.model_id:  # a Hub id or s3:// URL, downloaded when the container starts (docs/models.md)
        environment["HF_MODEL_ID"] = args.model_id
    for item in args.env:
        key, _, value = item.partition("=")
        environment[key] = value
    container: dict[str, Any] = {"Image": args.image, "Environment": environment}
    if args.model_data:
        container["ModelDataUrl"] = args.model_data
    return {
        "create_model": {"ModelName": args.name, "ExecutionRoleArn": args.role, "PrimaryContainer": container},
        "create_endpoint_config": {
            "EndpointConfigName": args.name,
            "ProductionVariants": [
                {
                    "VariantName": "AllTraffic",
                    "ModelName": args.name,
                    "InstanceType": args.instance_type,
                    "InitialInstanceCount": args.instance_count,
                    # /ping answers 503 until the model is loaded: give a large model time
                    "ContainerStartupHealthCheckTimeoutInSeconds": args.startup_timeout,
                    "ModelDataDownloadTimeoutInSeconds": 1200,
                }
            ],
        },
        "create_endpoint": {"EndpointName": args.name, "EndpointConfigName": args.name},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True, help="the lmiserve image in ECR")
    parser.add_argument("--role", required=True, help="the SageMaker execution role ARN")
    parser.add_argument("--name", default="lmiserve", help="model, endpoint config and endpoint name")
    parser.add_argument("--model-data", help="s3://.../model.tar.gz (omit: the model baked into the image)")
    parser.add_argument("--model-name", help="the name lmiserve reports (default: derived from the model)")
    parser.add_argument(
        "--model-id", help="a Hub id (org/name) or s3://bucket/prefix the container downloads at start (HF_MODEL_ID)"
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more container environment (repeatable): HF_TOKEN=..., OPTION_DTYPE=bf16, ...",
    )
    parser.add_argument(
        "--startup-timeout",
        type=int,
        default=600,
        help="seconds SageMaker waits for /ping to answer 200 (a model downloaded at start needs more)",
    )
    parser.add_argument("--instance-type", default="ml.m5.xlarge", help="e.g. ml.g5.xlarge for the CUDA image")
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument("--region", help="AWS region (default: the configured one)")
    parser.add_argument("--dry-run", action="store_true", help="print the requests, send nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    calls = requests(args)
    if args.dry_run:
        json.dump(calls, sys.stdout, indent=2)
        print()
        return 0
    import boto3  # only to deploy for real

    sagemaker = boto3.client("sagemaker", region_name=args.region)
    for operation, request in calls.items():
        getattr(sagemaker, operation)(**request)
        print(f"{operation}: {args.name}")
    print("waiting for the endpoint to be InService ...")
    sagemaker.get_waiter("endpoint_in_service").wait(EndpointName=args.name)
    print(f"endpoint {args.name} is InService")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
