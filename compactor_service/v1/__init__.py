"""Code generated from ``protos/compactor_service/v1/compactor.proto`` by
``scripts/gen_protos.py`` (CI checks it for drift): ``compactor_pb2`` (messages) and
``compactor_pb2_grpc`` (the service's stub and servicer base)."""
