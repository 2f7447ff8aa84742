//! A device address typed by the elements it holds, so that a kernel wrapper taking a `DevPtr<u16>` (BF16
//! weights) refuses a `DevPtr<f32>` (activations) at compile time.

use std::marker::PhantomData;

/// The device address of elements of `T` (a kernel's `T*`). Zero is "none" for a kernel's optional inputs.
pub struct DevPtr<T> {
    addr: u64,
    of: PhantomData<fn() -> T>,
}

impl<T> DevPtr<T> {
    /// No buffer: a kernel skips an optional input or output given as null.
    pub const NULL: DevPtr<T> = DevPtr::new(0);

    pub const fn new(addr: u64) -> DevPtr<T> {
        DevPtr {
            addr,
            of: PhantomData,
        }
    }

    pub fn addr(self) -> u64 {
        self.addr
    }

    /// The address `bytes` further on (the same element type).
    pub fn byte_add(self, bytes: u64) -> DevPtr<T> {
        DevPtr::new(self.addr + bytes)
    }
}

// By hand: derives would require `T` itself to be Copy, Eq, ….
impl<T> Clone for DevPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevPtr<T> {}

impl<T> Default for DevPtr<T> {
    fn default() -> Self {
        DevPtr::NULL
    }
}
