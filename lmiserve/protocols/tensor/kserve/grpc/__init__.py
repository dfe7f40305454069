"""The Open Inference Protocol over gRPC (KServe's `grpc_predict_v2`, the service Triton serves, with
Triton's `ModelStreamInfer` and repository index) on `grpc_port`: servicer.py; the wire messages in
oip.proto / grpc_service.proto and their generated code (oip_pb2.py, grpc_service_pb2_grpc.py)."""
