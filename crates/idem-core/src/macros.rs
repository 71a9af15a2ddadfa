//! Small macros the layers share.

/// Defines `get_ref`, `get_mut` and `into_inner` for a middleware whose wrapped service
/// is the field `$field` (tower-http's accessors, in one place).
#[doc(hidden)]
#[macro_export]
macro_rules! define_inner_service_accessors {
    ($field:ident) => {
        /// The inner service.
        pub fn get_ref(&self) -> &S {
            &self.$field
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.$field
        }

        /// Unwraps the inner service.
        pub fn into_inner(self) -> S {
            self.$field
        }
    };
}
