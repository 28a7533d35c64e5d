"""From a schedule to what each rank runs: messages, the exchange program, the NCCL model, the validator."""
