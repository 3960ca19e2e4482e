/* What nccl.c uses of cuda.c (both are kiln's test doubles; see README.md). */
#ifndef KILN_EMU_H
#define KILN_EMU_H
#include <stddef.h>
#include <stdint.h>

/* Whether [ptr, ptr + bytes) lies inside one live emulated device allocation. */
int kiln_emu_is_device(const void *ptr, size_t bytes);
/* Queues run(arg) on a stream (0, 1, 2: the default stream), after the work already there. */
void kiln_emu_enqueue(void *stream, void (*run)(void *), void *arg);
/* The calling thread's current device (0 without a current context). */
int kiln_emu_current_device(void);
/* A device's physical identity (what NCCL compares to refuse two ranks on one GPU). */
uint64_t kiln_emu_device_bus_id(int ordinal);
#endif
