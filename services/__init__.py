"""mneme services: one package per service (handlers, gRPC servicers, __main__)."""
