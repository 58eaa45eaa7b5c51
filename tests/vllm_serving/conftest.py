"""tests/vllm_serving runs in the vLLM environment only (make test-vllm, .venv-vllm): in an environment without vLLM (the
main .venv of make test) its tests are not collected at all."""
import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["test_vllm_serving.py", "test_vllm_server.py", "test_vllm_tensor_parallel.py"]
