"""The commit protocol: how a checkpoint's files become durable and committed, and the verified reads."""
