//! How a typed kernel wrapper (kernels.rs) becomes a launch: each wrapper is a struct whose fields are its
//! kernel's parameters, by name and in order; each field's type knows the C type it stands for and how it is
//! passed ([`Param`]), and the fields go to the untyped [`Launch`] in declaration order.

use crate::devptr::DevPtr;
use crate::gpu::{Gpu, Launch};

/// A kernel parameter's Rust type: how its value is passed, and (for the signature test) the C type it is
/// declared as in kernels.cu (`const` dropped).
pub(crate) trait Param {
    #[cfg(test)]
    const C: &'static str;
    fn pass(self, l: Launch<'_>) -> Launch<'_>;
}

/// An element type of device memory (and the C type of a pointer to it).
pub(crate) trait Elem {
    #[cfg(test)]
    const PTR: &'static str;
}

/// `elem!(rust => "c", …)`: each Rust element type and the C type of a pointer to it.
macro_rules! elem {
    ($($t:ty => $c:literal),*) => {
        $(impl Elem for $t {
            #[cfg(test)]
            const PTR: &'static str = $c;
        })*
    };
}
elem!(f32 => "float*", u16 => "u16*", u32 => "u32*", i32 => "int*", u64 => "u64*", u8 => "u8*");

impl<T: Elem> Param for DevPtr<T> {
    #[cfg(test)]
    const C: &'static str = T::PTR;
    fn pass(self, l: Launch<'_>) -> Launch<'_> {
        l.p(self.addr())
    }
}

/// Passed as its 8 bytes, as the kernel's `double` parameter holds them.
impl Param for f64 {
    #[cfg(test)]
    const C: &'static str = "double";
    fn pass(self, l: Launch<'_>) -> Launch<'_> {
        l.p(self.to_bits())
    }
}

/// Sizes and counts, passed as C `int` (checked to fit).
impl Param for usize {
    #[cfg(test)]
    const C: &'static str = "int";
    fn pass(self, l: Launch<'_>) -> Launch<'_> {
        l.i(self)
    }
}

impl Param for f32 {
    #[cfg(test)]
    const C: &'static str = "float";
    fn pass(self, l: Launch<'_>) -> Launch<'_> {
        l.f(self)
    }
}

/// `int_param!(T, …)`: types the kernels take as `int`, passed as their value (a flag's 0 or 1, an enum's
/// discriminant).
macro_rules! int_param {
    ($($t:ty),*) => {
        $(impl $crate::launch::Param for $t {
            #[cfg(test)]
            const C: &'static str = "int";
            fn pass(self, l: $crate::gpu::Launch<'_>) -> $crate::gpu::Launch<'_> {
                l.i(self as usize)
            }
        })*
    };
}
pub(crate) use int_param;
int_param!(bool);

/// An expert record's six tensor offsets, the kernels' `Parts`.
impl Param for [u64; 6] {
    #[cfg(test)]
    const C: &'static str = "Parts";
    fn pass(self, l: Launch<'_>) -> Launch<'_> {
        l.parts(self)
    }
}

/// A kernel's parameter list as a struct (made by [`kernel!`]).
pub(crate) trait Kernel {
    /// The kernels of kernels.cu that take this parameter list (one, or the variants of one kernel).
    const NAMES: &'static [&'static str];
    /// Each parameter's name and C type, in order.
    #[cfg(test)]
    const PARAMS: &'static [(&'static str, &'static str)];
    /// Passes every parameter, in order.
    fn pass(self, l: Launch<'_>) -> Launch<'_>;
}

/// Kernel `name` (one of `K::NAMES`) with the parameters `k`, on a grid of `grid` blocks of `block` threads with
/// `shared` bytes of dynamic shared memory; the caller picks the stream and launches (`Launch::go`).
pub(crate) fn launch<'a, K: Kernel>(
    gpu: &'a Gpu,
    name: &'static str,
    grid: (u32, u32),
    block: u32,
    shared: u32,
    k: K,
) -> Launch<'a> {
    debug_assert!(K::NAMES.contains(&name), "{name} takes other parameters");
    k.pass(Launch::new(gpu, name, grid, block, shared))
}

/// A kernel wrapper: `Name = ["kernel", …] { field: Type, … }` makes `pub(crate) struct Name` with those fields
/// and its [`Kernel`] impl, the fields passed in the order written (which must be the kernel's). Followed by
/// `grid G, block B, smem S` (expressions of the fields), it also makes `Name::go(self, gpu)`, which launches
/// the kernel on the compute stream with that shape.
macro_rules! kernel {
    ($(#[$doc:meta])* $name:ident = [$kernel:literal] {
        $($(#[$fdoc:meta])* $field:ident: $ty:ty,)*
    } grid $grid:expr, block $block:expr, smem $smem:expr) => {
        $crate::launch::kernel! {
            $(#[$doc])* $name = [$kernel] { $($(#[$fdoc])* $field: $ty,)* }
        }

        impl $name {
            #[allow(unused_variables)] // the fields the shape does not use
            pub(crate) fn go(self, gpu: &$crate::gpu::Gpu) -> anyhow::Result<()> {
                let &$name { $($field),* } = &self;
                $crate::launch::launch(gpu, $kernel, $grid, $block, $smem, self).go()
            }
        }
    };
    ($(#[$doc:meta])* $name:ident = [$($kernel:literal),+] {
        $($(#[$fdoc:meta])* $field:ident: $ty:ty,)*
    }) => {
        $(#[$doc])*
        pub(crate) struct $name {
            $($(#[$fdoc])* pub(crate) $field: $ty,)*
        }

        impl $crate::launch::Kernel for $name {
            const NAMES: &'static [&'static str] = &[$($kernel),+];
            #[cfg(test)]
            const PARAMS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($field), <$ty as $crate::launch::Param>::C)),*];
            fn pass(self, l: $crate::gpu::Launch<'_>) -> $crate::gpu::Launch<'_> {
                $(let l = $crate::launch::Param::pass(self.$field, l);)*
                l
            }
        }
    };
}
pub(crate) use kernel;
