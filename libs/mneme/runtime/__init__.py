"""The runtimes that run the services the composition root (:mod:`mneme.bootstrap`)
builds: the gRPC server kit (:mod:`.grpc_server`), the embedded topology
(:mod:`.embedded`: every service in one process over the SQLite log, run by
:mod:`.log_runner`), one service per process over Kafka (:mod:`.process`, its consumer
groups through FastStream: :mod:`.kafka`), and replay (:mod:`.replay`)."""
