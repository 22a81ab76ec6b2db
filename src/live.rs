//! A setting a reload replaces while tasks read it: readers take an `Arc` snapshot and keep it
//! for as long as they need one consistent view (a flight, a read), writers swap it whole.

use std::sync::{Arc, RwLock};

pub struct Live<T>(RwLock<Arc<T>>);

impl<T> Live<T> {
    pub fn new(value: T) -> Live<T> {
        Live(RwLock::new(Arc::new(value)))
    }

    /// The current value. The lock is held only to clone the `Arc`; a panic elsewhere cannot
    /// poison a value that is only ever replaced whole, so a poisoned lock is read through.
    pub fn get(&self) -> Arc<T> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set(&self, value: T) {
        self.set_shared(Arc::new(value));
    }

    /// [`Live::new`] with a value others hold too (the counter table, which the ingest schema
    /// holds as well).
    pub fn shared(value: Arc<T>) -> Live<T> {
        Live(RwLock::new(value))
    }

    /// [`Live::set`] with a value others hold too.
    pub fn set_shared(&self, value: Arc<T>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = value;
    }
}
