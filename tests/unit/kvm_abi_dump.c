/* Prints the KVM ioctl numbers and struct layouts as the kernel headers define
 * them, one "name value" per line. test_kvm_abi.py compiles and runs this when
 * a C compiler and the kernel headers are present, and compares every line with
 * our ctypes mirror. */
#include <stddef.h>
#include <stdio.h>
#include <linux/kvm.h>

#define N(x) printf("%s %lu\n", #x, (unsigned long)(x))
#define SZ(t) printf("sizeof:%s %zu\n", #t, sizeof(struct t))
#define OFF(t, f) printf("offsetof:%s.%s %zu\n", #t, #f, offsetof(struct t, f))

int main(void) {
    N(KVM_GET_API_VERSION); N(KVM_CREATE_VM); N(KVM_GET_MSR_INDEX_LIST);
    N(KVM_CHECK_EXTENSION); N(KVM_GET_VCPU_MMAP_SIZE); N(KVM_GET_SUPPORTED_CPUID);
    N(KVM_GET_MSR_FEATURE_INDEX_LIST); N(KVM_CREATE_VCPU); N(KVM_GET_DIRTY_LOG);
    N(KVM_SET_USER_MEMORY_REGION); N(KVM_SET_TSS_ADDR); N(KVM_SET_IDENTITY_MAP_ADDR);
    N(KVM_CREATE_IRQCHIP); N(KVM_IRQ_LINE); N(KVM_GET_IRQCHIP); N(KVM_SET_IRQCHIP);
    N(KVM_IRQFD); N(KVM_CREATE_PIT2); N(KVM_IOEVENTFD); N(KVM_SET_CLOCK); N(KVM_GET_CLOCK);
    N(KVM_GET_PIT2); N(KVM_SET_PIT2); N(KVM_RUN); N(KVM_GET_REGS); N(KVM_SET_REGS);
    N(KVM_GET_SREGS); N(KVM_SET_SREGS); N(KVM_GET_MSRS); N(KVM_SET_MSRS); N(KVM_GET_FPU);
    N(KVM_SET_FPU); N(KVM_GET_LAPIC); N(KVM_SET_LAPIC); N(KVM_SET_CPUID2); N(KVM_GET_CPUID2);
    N(KVM_GET_MP_STATE); N(KVM_SET_MP_STATE); N(KVM_GET_VCPU_EVENTS); N(KVM_SET_VCPU_EVENTS);
    N(KVM_GET_DEBUGREGS); N(KVM_SET_DEBUGREGS); N(KVM_SET_TSC_KHZ); N(KVM_GET_TSC_KHZ);
    N(KVM_ENABLE_CAP); N(KVM_GET_XSAVE); N(KVM_SET_XSAVE); N(KVM_GET_XCRS); N(KVM_SET_XCRS);
    N(KVM_KVMCLOCK_CTRL); N(KVM_GET_XSAVE2);

    SZ(kvm_regs); OFF(kvm_regs, rip); OFF(kvm_regs, rflags);
    SZ(kvm_segment); OFF(kvm_segment, selector); OFF(kvm_segment, type); OFF(kvm_segment, unusable);
    SZ(kvm_dtable); OFF(kvm_dtable, limit);
    SZ(kvm_sregs); OFF(kvm_sregs, ldt); OFF(kvm_sregs, gdt); OFF(kvm_sregs, idt);
    OFF(kvm_sregs, cr0); OFF(kvm_sregs, efer); OFF(kvm_sregs, apic_base); OFF(kvm_sregs, interrupt_bitmap);
    SZ(kvm_fpu); OFF(kvm_fpu, fcw); OFF(kvm_fpu, last_ip); OFF(kvm_fpu, xmm); OFF(kvm_fpu, mxcsr);
    SZ(kvm_msr_entry); OFF(kvm_msr_entry, data);
    SZ(kvm_msrs); OFF(kvm_msrs, entries);
    SZ(kvm_msr_list); OFF(kvm_msr_list, indices);
    SZ(kvm_cpuid_entry2); OFF(kvm_cpuid_entry2, eax); OFF(kvm_cpuid_entry2, edx);
    SZ(kvm_cpuid2); OFF(kvm_cpuid2, entries);
    SZ(kvm_lapic_state); SZ(kvm_mp_state);
    SZ(kvm_vcpu_events); OFF(kvm_vcpu_events, interrupt); OFF(kvm_vcpu_events, nmi);
    OFF(kvm_vcpu_events, sipi_vector); OFF(kvm_vcpu_events, flags); OFF(kvm_vcpu_events, smi);
    OFF(kvm_vcpu_events, exception_has_payload); OFF(kvm_vcpu_events, exception_payload);
    SZ(kvm_debugregs); OFF(kvm_debugregs, dr6); OFF(kvm_debugregs, flags);
    SZ(kvm_xsave); SZ(kvm_xcr); SZ(kvm_xcrs); OFF(kvm_xcrs, xcrs); OFF(kvm_xcrs, padding);
    SZ(kvm_irqchip); OFF(kvm_irqchip, chip);
    SZ(kvm_pit_channel_state); OFF(kvm_pit_channel_state, count_load_time); OFF(kvm_pit_channel_state, gate);
    SZ(kvm_pit_state2); OFF(kvm_pit_state2, flags);
    SZ(kvm_pit_config); SZ(kvm_clock_data); OFF(kvm_clock_data, realtime); OFF(kvm_clock_data, host_tsc);
    SZ(kvm_userspace_memory_region); OFF(kvm_userspace_memory_region, userspace_addr);
    SZ(kvm_irq_level); SZ(kvm_ioeventfd); OFF(kvm_ioeventfd, fd); OFF(kvm_ioeventfd, flags);
    SZ(kvm_irqfd); OFF(kvm_irqfd, resamplefd); SZ(kvm_dirty_log); OFF(kvm_dirty_log, dirty_bitmap);
    SZ(kvm_enable_cap); OFF(kvm_enable_cap, args);
    OFF(kvm_run, immediate_exit); OFF(kvm_run, exit_reason); OFF(kvm_run, if_flag);
    OFF(kvm_run, cr8); OFF(kvm_run, apic_base); OFF(kvm_run, io); OFF(kvm_run, mmio);
    OFF(kvm_run, internal); OFF(kvm_run, system_event); OFF(kvm_run, kvm_valid_regs);
    OFF(kvm_run, kvm_dirty_regs);
    return 0;
}
