/* Asks the CUDA runtime once whether the GPU stages can run here: the CTest fixture gpu.probe
 * (cmake/gpu_probe.cmake) runs it before the GPU tests, so that without a GPU they skip at
 * once (common/gpu_gate.c) instead of each paying for the runtime's own search.
 * Prints one line and exits 0 where device 0 is a CUDA device of compute capability 8.0 or
 * later, as common/gpu.cu's gpu_open() requires, and 77 where it is not. */
#include <cuda_runtime_api.h>
#include <stdio.h>

int main(void) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    printf("no CUDA device\n");
    return 77;
  }
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    printf("no CUDA device usable (its properties could not be read)\n");
    return 77;
  }
  if (prop.major < 8) {
    printf("no CUDA device of compute capability 8.0 or later (%s is %d.%d)\n", prop.name,
           prop.major, prop.minor);
    return 77;
  }
  printf("CUDA device: %s, compute capability %d.%d\n", prop.name, prop.major, prop.minor);
  return 0;
}
