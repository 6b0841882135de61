# megamoe must be imported before triton: on a machine without CUDA it switches Triton to its interpreter.
import megamoe  # noqa: F401
