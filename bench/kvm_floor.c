/*
 * The floor for bench/spawn.py: only the KVM calls that restoring a snapshot
 * needs, in C, with no VMM around them.
 *
 *   kvm_floor MEMORY_FILE MEM_BYTES N
 *
 * Like the zygote, the parent does the per-host work once (the MSR index list
 * and the supported CPUID, both answers of /dev/kvm that never change) and then
 * forks N children back to back. Each child, in parallel with its siblings:
 *
 *   open /dev/kvm, KVM_CREATE_VM, KVM_SET_TSS_ADDR, KVM_CREATE_IRQCHIP,
 *   KVM_CREATE_PIT2, mmap(MAP_PRIVATE) the memory file,
 *   KVM_SET_USER_MEMORY_REGION, KVM_CREATE_VCPU, mmap of kvm_run,
 *   KVM_SET_CPUID2 (MSRs and XSAVE state depend on it, so a restore must set it
 *   first), then GET+SET of REGS, SREGS, FPU, LAPIC, MSRS, VCPU_EVENTS and
 *   GET+SET of the irqchips (PIC master, PIC slave, IOAPIC), PIT2 and CLOCK.
 *
 * The values set are the vCPU's and VM's own (read back just before): the cost
 * of an ioctl does not depend on the values, and this keeps the floor free of
 * a snapshot parser. Nothing touches guest memory and no vCPU runs, so no page
 * of the memory file is faulted in -- the same as a restore before KVM_RUN.
 *
 * A child writes its own elapsed time (ns, 8 bytes: atomic on a pipe) when
 * done and then stays alive until the parent kills it, so the VMs are torn
 * down after the clock stops (as vmfork's children stay alive).
 *
 * Output, one JSON line on stdout:
 *   {"n": N, "wall_s": ..., "child_s": [...]}
 * wall_s runs from just before the first fork to the N-th "done".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_MSRS 1024
#define MAX_CPUID 256
#define TSS_ADDR 0xfffbd000UL

static struct kvm_msr_list *msr_list;
static struct kvm_cpuid2 *cpuid;

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* In a child: name the failed step and exit; the parent sees a short count. */
static void fail(const char *step)
{
	fprintf(stderr, "kvm_floor[%d]: %s: %s\n", getpid(), step, strerror(errno));
	_exit(2);
}

static void xioctl(int fd, unsigned long req, void *arg, const char *name)
{
	if (ioctl(fd, req, arg) < 0)
		fail(name);
}

static void restore_one(const char *mem_path, size_t mem_bytes)
{
	int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
	if (kvm < 0)
		fail("open /dev/kvm");
	int vm = ioctl(kvm, KVM_CREATE_VM, 0);
	if (vm < 0)
		fail("KVM_CREATE_VM");
	if (ioctl(vm, KVM_SET_TSS_ADDR, TSS_ADDR) < 0)
		fail("KVM_SET_TSS_ADDR");
	if (ioctl(vm, KVM_CREATE_IRQCHIP, 0) < 0)
		fail("KVM_CREATE_IRQCHIP");
	struct kvm_pit_config pit_config = { .flags = KVM_PIT_SPEAKER_DUMMY };
	xioctl(vm, KVM_CREATE_PIT2, &pit_config, "KVM_CREATE_PIT2");

	int mem_fd = open(mem_path, O_RDONLY | O_CLOEXEC);
	if (mem_fd < 0)
		fail("open memory file");
	void *mem = mmap(NULL, mem_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, mem_fd, 0);
	if (mem == MAP_FAILED)
		fail("mmap memory file");
	struct kvm_userspace_memory_region region = {
		.slot = 0, .guest_phys_addr = 0, .memory_size = mem_bytes,
		.userspace_addr = (uint64_t)(uintptr_t)mem,
	};
	xioctl(vm, KVM_SET_USER_MEMORY_REGION, &region, "KVM_SET_USER_MEMORY_REGION");

	int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0);
	if (vcpu < 0)
		fail("KVM_CREATE_VCPU");
	int run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
	if (run_size < 0)
		fail("KVM_GET_VCPU_MMAP_SIZE");
	void *run = mmap(NULL, (size_t)run_size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
	if (run == MAP_FAILED)
		fail("mmap kvm_run");
	xioctl(vcpu, KVM_SET_CPUID2, cpuid, "KVM_SET_CPUID2");

	struct kvm_regs regs;
	xioctl(vcpu, KVM_GET_REGS, &regs, "KVM_GET_REGS");
	xioctl(vcpu, KVM_SET_REGS, &regs, "KVM_SET_REGS");
	struct kvm_sregs sregs;
	xioctl(vcpu, KVM_GET_SREGS, &sregs, "KVM_GET_SREGS");
	xioctl(vcpu, KVM_SET_SREGS, &sregs, "KVM_SET_SREGS");
	struct kvm_fpu fpu;
	xioctl(vcpu, KVM_GET_FPU, &fpu, "KVM_GET_FPU");
	xioctl(vcpu, KVM_SET_FPU, &fpu, "KVM_SET_FPU");
	struct kvm_lapic_state lapic;
	xioctl(vcpu, KVM_GET_LAPIC, &lapic, "KVM_GET_LAPIC");
	xioctl(vcpu, KVM_SET_LAPIC, &lapic, "KVM_SET_LAPIC");

	/* GET_MSRS/SET_MSRS return how many entries they handled and stop at the
	 * first MSR they cannot; set back exactly the ones that were read. */
	static struct {
		struct kvm_msrs hdr;
		struct kvm_msr_entry entries[MAX_MSRS];
	} msrs;
	msrs.hdr.nmsrs = msr_list->nmsrs;
	for (uint32_t i = 0; i < msr_list->nmsrs; i++)
		msrs.entries[i] = (struct kvm_msr_entry){ .index = msr_list->indices[i] };
	int got = ioctl(vcpu, KVM_GET_MSRS, &msrs);
	if (got < 0)
		fail("KVM_GET_MSRS");
	msrs.hdr.nmsrs = (uint32_t)got;
	if (ioctl(vcpu, KVM_SET_MSRS, &msrs) < 0)
		fail("KVM_SET_MSRS");

	struct kvm_vcpu_events events;
	xioctl(vcpu, KVM_GET_VCPU_EVENTS, &events, "KVM_GET_VCPU_EVENTS");
	xioctl(vcpu, KVM_SET_VCPU_EVENTS, &events, "KVM_SET_VCPU_EVENTS");

	for (uint32_t chip = 0; chip < 3; chip++) {
		struct kvm_irqchip irqchip = { .chip_id = chip };
		xioctl(vm, KVM_GET_IRQCHIP, &irqchip, "KVM_GET_IRQCHIP");
		xioctl(vm, KVM_SET_IRQCHIP, &irqchip, "KVM_SET_IRQCHIP");
	}
	struct kvm_pit_state2 pit;
	xioctl(vm, KVM_GET_PIT2, &pit, "KVM_GET_PIT2");
	xioctl(vm, KVM_SET_PIT2, &pit, "KVM_SET_PIT2");
	struct kvm_clock_data clock;
	xioctl(vm, KVM_GET_CLOCK, &clock, "KVM_GET_CLOCK");
	/* GET reports status flags (TSC_STABLE, REALTIME...); SET takes the value only. */
	clock.flags = 0;
	xioctl(vm, KVM_SET_CLOCK, &clock, "KVM_SET_CLOCK");
}

static void load_host_answers(void)
{
	int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
	if (kvm < 0)
		fail("open /dev/kvm");
	msr_list = calloc(1, sizeof(*msr_list) + MAX_MSRS * sizeof(uint32_t));
	cpuid = calloc(1, sizeof(*cpuid) + MAX_CPUID * sizeof(struct kvm_cpuid_entry2));
	if (msr_list == NULL || cpuid == NULL)
		fail("calloc");
	msr_list->nmsrs = MAX_MSRS;
	xioctl(kvm, KVM_GET_MSR_INDEX_LIST, msr_list, "KVM_GET_MSR_INDEX_LIST");
	cpuid->nent = MAX_CPUID;
	xioctl(kvm, KVM_GET_SUPPORTED_CPUID, cpuid, "KVM_GET_SUPPORTED_CPUID");
	close(kvm);
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: %s MEMORY_FILE MEM_BYTES N\n", argv[0]);
		return 2;
	}
	const char *mem_path = argv[1];
	size_t mem_bytes = strtoull(argv[2], NULL, 0);
	int n = atoi(argv[3]);
	if (n < 1 || n > 10000 || mem_bytes == 0) {
		fprintf(stderr, "kvm_floor: bad MEM_BYTES or N\n");
		return 2;
	}
	load_host_answers();

	int done[2];
	if (pipe2(done, O_CLOEXEC) < 0)
		fail("pipe2");
	pid_t *pids = calloc((size_t)n, sizeof(pid_t));
	uint64_t *child_ns = calloc((size_t)n, sizeof(uint64_t));
	if (pids == NULL || child_ns == NULL)
		fail("calloc");

	uint64_t started = now_ns();
	int forked = 0;
	for (; forked < n; forked++) {
		pid_t pid = fork();
		if (pid < 0) {
			fprintf(stderr, "kvm_floor: fork %d: %s\n", forked, strerror(errno));
			break;
		}
		if (pid == 0) {
			uint64_t t0 = now_ns();
			restore_one(mem_path, mem_bytes);
			uint64_t elapsed = now_ns() - t0;
			if (write(done[1], &elapsed, sizeof(elapsed)) != sizeof(elapsed))
				fail("write done");
			for (;;)
				pause();
		}
		pids[forked] = pid;
	}
	close(done[1]);
	/* Stop at n answers, or as soon as any child has exited: a child that
	 * failed exits, and the live siblings keep the pipe open, so no EOF comes. */
	int answered = 0;
	int dead = 0;
	while (answered < forked && !dead) {
		struct pollfd pfd = { .fd = done[0], .events = POLLIN };
		int ready = poll(&pfd, 1, 100);
		if (ready > 0) {
			ssize_t got = read(done[0], &child_ns[answered], sizeof(uint64_t));
			if (got == (ssize_t)sizeof(uint64_t))
				answered++;
			else if (got == 0 || (got < 0 && errno != EINTR))
				break;
		} else if (ready == 0 && waitpid(-1, NULL, WNOHANG) > 0) {
			dead = 1;
		}
	}
	uint64_t wall = now_ns() - started;

	for (int i = 0; i < forked; i++)
		kill(pids[i], SIGKILL);
	for (int i = 0; i < forked; i++)
		waitpid(pids[i], NULL, 0); /* ECHILD for one reaped above: fine */

	if (answered < n) {
		fprintf(stderr, "kvm_floor: only %d of %d children completed the restore calls\n",
			answered, n);
		return 1;
	}
	printf("{\"n\": %d, \"wall_s\": %.9f, \"child_s\": [", n, (double)wall / 1e9);
	for (int i = 0; i < n; i++)
		printf("%s%.9f", i ? ", " : "", (double)child_ns[i] / 1e9);
	printf("]}\n");
	return 0;
}
