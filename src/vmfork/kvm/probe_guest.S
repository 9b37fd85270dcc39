# The throwaway guest behind vmfork.kvm.probe: times a kernel-mode loop, then
# checks that `syscall` from user mode lands in kernel mode (CPL 0).
# Build: as -o p.o probe_guest.S && ld -Ttext=0x100000 --oformat binary -e _start -o p.bin p.o
# The bytes are embedded in probe.py; tests/unit/test_probe_guest.py rebuilds and compares.
    .code64
    .globl _start
_start:
    mov $0xAA, %al
    out %al, $0xE9               # loop start marker
    mov $1000000, %ecx
1:  dec %ecx
    jnz 1b
    mov $0xBB, %al
    out %al, $0xE9               # loop end marker
    # make the identity map user-accessible (U bit in PML4[0], PDPT[0], PD[0])
    orq $4, 0x9000
    orq $4, 0xA000
    orq $4, 0xB000
    mov %cr3, %rax
    mov %rax, %cr3
    # GDT entries 4 (user data, DPL3) and 5 (user 64-bit code, DPL3)
    movabs $0x00CFF3000000FFFF, %rax
    mov %rax, 0x600 + 32
    movabs $0x00AFFB000000FFFF, %rax
    mov %rax, 0x600 + 40
    # copy the 4 boot entries to 0x600 and load the bigger GDT
    mov 0x500, %rax
    mov %rax, 0x600
    mov 0x508, %rax
    mov %rax, 0x608
    mov 0x510, %rax
    mov %rax, 0x610
    mov 0x518, %rax
    mov %rax, 0x618
    movw $47, 0x700
    movq $0x600, 0x702
    lgdt 0x700
    # syscall: EFER.SCE, STAR (kernel CS 0x08), LSTAR = handler, SFMASK = IF
    mov $0xC0000080, %ecx
    rdmsr
    or $1, %eax
    wrmsr
    mov $0xC0000081, %ecx
    xor %eax, %eax
    mov $0x00100008, %edx        # STAR[47:32]=0x08, STAR[63:48]=0x10
    wrmsr
    mov $0xC0000082, %ecx
    lea handler(%rip), %rax
    mov %rax, %rdx
    shr $32, %rdx
    wrmsr
    mov $0xC0000084, %ecx
    mov $0x200, %eax
    xor %edx, %edx
    wrmsr
    # drop to CPL 3 with iretq: SS, RSP, RFLAGS, CS, RIP
    pushq $0x23
    pushq $0x80000
    pushq $0x2
    pushq $0x2B
    lea user(%rip), %rax
    push %rax
    iretq
user:
    syscall
    ud2
handler:
    mov %cs, %ax
    and $3, %al
    out %al, $0xE9               # CPL of the syscall handler: 0 when syscall works
    mov $0xFE, %al
    out %al, $0x64               # i8042 reset: end the VM
2:  hlt
    jmp 2b
