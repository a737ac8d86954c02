"""Weight-sync transports: how new policy weights reach the generation backend."""
