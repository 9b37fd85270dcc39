# A tiny guest that executes a script of memory/MMIO operations written by the
# host at 0x200000, so KVM tests can drive devices as a guest driver would
# without booting Linux. Each entry is three u64: op, address, value.
#   op 1: write32 [address] = value
#   op 2: read32 [address] and write the 4 bytes to port 0xE9 (host records them)
#   op 3: spin while u16 [address] == value (wait for a device to publish)
#   op 4: in8 from port <address>, write the byte to port 0xE9
#   op 5: spin forever incrementing u64 [address] (pause/kick tests)
#   op 6: forever: counter += 1, then write the u64 counter at the start of each of
#         <value> pages from <address> in order (snapshot consistency tests: at any
#         instant the pages hold c,...,c,c-1,...,c-1)
#   op 0 (or anything else): end the VM through the i8042 reset line
# Build: as -o g.o mmio_script.S && ld -Ttext=0x100000 --oformat binary -e _start -o g.bin g.o
    .code64
    .globl _start
_start:
    mov $0x200000, %rsi
next:
    mov (%rsi), %rax
    mov 8(%rsi), %rdi
    mov 16(%rsi), %rbx
    add $24, %rsi
    cmp $1, %rax
    je write32
    cmp $2, %rax
    je read32
    cmp $3, %rax
    je wait16
    cmp $4, %rax
    je in8
    cmp $5, %rax
    je count
    cmp $6, %rax
    je fill
    mov $0xFE, %al
    out %al, $0x64
1:  hlt
    jmp 1b
write32:
    mov %ebx, (%rdi)
    jmp next
read32:
    mov (%rdi), %eax
    out %eax, $0xE9
    jmp next
wait16:
    movzwl (%rdi), %eax
    cmp %ebx, %eax
    je wait16
    jmp next
in8:
    mov %edi, %edx
    in %dx, %al
    out %al, $0xE9
    jmp next
count:
    incq (%rdi)
    jmp count
fill:
    xor %rcx, %rcx
1:  inc %rcx
    mov %rdi, %rdx
    mov %rbx, %r8
2:  mov %rcx, (%rdx)
    add $4096, %rdx
    dec %r8
    jnz 2b
    jmp 1b
