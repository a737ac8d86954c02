"""SGLang generation backend: a running SGLang server over HTTP, or ``sglang.Engine`` in this process (docs/sglang.md)."""
