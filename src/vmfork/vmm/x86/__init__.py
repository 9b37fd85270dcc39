"""x86-64 specifics: the boot recipe, the guest CPUID, the MP table."""
